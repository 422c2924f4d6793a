"""The status bar's memory meter names the KV cache's share of RAM and its budget (issue 64: a chat app took 30% of
the machine's RAM and said nothing), over the real engine, offscreen."""

from __future__ import annotations

import pytest
from qt_helpers import WAIT_MS


@pytest.fixture
def small_cache_client(qtbot, client, smollm):
    with qtbot.waitSignal(client.model_loaded, timeout=WAIT_MS):
        client.use_engine(smollm.with_options(cache_bytes=24 << 20))
    return client


def test_the_meter_shows_the_kv_caches_ram_against_its_budget_and_why(qtbot, small_cache_client):
    from app.memory_meter import MemoryMeter

    meter = MemoryMeter(small_cache_client)
    try:
        meter.update_now()
        # a CPU-only machine: the device tier is RAM, and its budget was set; the overflow tier's is the default
        assert "KV cache: RAM 0 B of 24.0 MB" in meter.text()
        tooltip = meter.toolTip()
        assert "RAM: 0 B of 24.0 MB (set by cache_bytes)" in tooltip
        assert "overflow RAM: 0 B of " in tooltip and "(default: 1/3 of " in tooltip
    finally:
        meter.stop()
