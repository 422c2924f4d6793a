"""What the KV cache holds in RAM, as GET /health says it: each tier's budget, the bytes and chunks filling it and
where the budget came from; and a run of distinct chats that stays within it (issue 64: the default budget filled
silently, ~1.8 MB a request)."""

from __future__ import annotations

import os

import httpx
import pytest
from server_helpers import RunningServer

WORDS = ("harbour ferry island ticket crown pier morning evening market bridge tower lantern captain cargo "
         "river meadow orchard quarry forest valley glacier canyon desert prairie").split()


def distinct_prompt(i: int, num_words: int = 160) -> str:
    """A prompt no other i shares from its first token on, so each request stores chunks of its own."""
    return f"Request {i}: " + " ".join(WORDS[(i * 7 + j * (i % 5 + 1)) % len(WORDS)] for j in range(num_words))


def ask(url: str, prompt: str) -> dict:
    reply = httpx.post(url + "/v1/completions", json={"model": "smollm2", "prompt": prompt, "max_tokens": 2,
                                                      "temperature": 0}, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def kv_cache(url: str) -> dict:
    reply = httpx.get(url + "/health", timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()["kv_cache"]


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(scope="module")
def small_cache_server(smollm):
    running = RunningServer(smollm.with_options(cache_bytes=24 << 20, cpu_cache_bytes=12 << 20))
    yield running
    running.stop()


def test_health_names_each_ram_tiers_budget_and_what_fills_it(server):
    before = kv_cache(server.url)
    assert set(before) >= {"device", "host"}
    for tier in ("device", "host"):
        assert before[tier]["budget_bytes"] > 0
        # no budget was set: the default rule is named (engine.ram_budget.default_ram_budget)
        assert before[tier]["budget_rule"].startswith("default: ")
        assert "RAM" in before[tier]["budget_rule"] or "available" in before[tier]["budget_rule"]
    ask(server.url, distinct_prompt(10_001))
    after = kv_cache(server.url)
    assert after["device"]["bytes"] > before["device"]["bytes"]
    assert after["device"]["entries"] > before["device"]["entries"]
    assert after["device"]["budget_bytes"] == before["device"]["budget_bytes"]


def test_a_set_budget_is_named_as_set(small_cache_server):
    tiers = kv_cache(small_cache_server.url)
    assert tiers["device"] == {"bytes": tiers["device"]["bytes"], "budget_bytes": 24 << 20,
                               "entries": tiers["device"]["entries"], "budget_rule": "set by cache_bytes"}
    assert tiers["host"]["budget_bytes"] == 12 << 20 and tiers["host"]["budget_rule"] == "set by cpu_cache_bytes"


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident size from /proc")
def test_distinct_chats_fill_the_ram_tiers_to_their_budget_and_no_further(small_cache_server):
    url = small_cache_server.url
    budget = (24 << 20) + (12 << 20)
    for i in range(3):  # warm-up: the allocator's arenas, the first batch's buffers
        ask(url, distinct_prompt(i))
    start = rss_bytes()
    peak = 0
    for i in range(3, 15):
        ask(url, distinct_prompt(i))
        tiers = kv_cache(url)
        assert tiers["device"]["bytes"] <= tiers["device"]["budget_bytes"]
        assert tiers["host"]["bytes"] <= tiers["host"]["budget_bytes"]
        peak = max(peak, rss_bytes() - start)
    assert tiers["device"]["bytes"] + tiers["host"]["bytes"] > budget // 2  # they did fill: the test means something
    # The slack: what the allocator keeps of freed payloads and per-request buffers, measured at ~20 MB here.
    slack = 64 << 20
    assert peak <= budget + slack, f"resident size grew {peak >> 20} MB over 12 distinct chats"
