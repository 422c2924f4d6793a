"""Shared fixtures. The real model (SmolLM2-135M-Instruct, embedded default) loads once per session."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _own_disk_cache_dir(tmp_path, monkeypatch):
    """Engines built with the default disk folder write into this test's own folder, never the user's."""
    monkeypatch.setenv("KVBOOST_CACHE_DIR", str(tmp_path / "kv-cache"))


@pytest.fixture(scope="session")
def smollm():
    """KVBoost over the real default model as the app loads it (weights="auto": its 4-bit GGUF as int4) with
    reuse="chunk" and no disk tier (it lives for the whole session; entries on disk would outlive the test that
    made them). Tests that need another setting call
    `smollm.with_options(...)` (e.g. disk_cache_dir=tmp_path, disk_cache_bytes=None), which shares the loaded
    weights and starts empty memory tiers."""
    from engine import KVBoost

    return KVBoost.from_pretrained(device="cpu", disk_cache_bytes=0)


@pytest.fixture(scope="session")
def smollm_float():
    """The same real model loaded with weights="float" (the default, "auto", loads its 4-bit GGUF as int4): for
    tests that compare against transformers' float model or quantize a float copy themselves."""
    from engine import KVBoost

    engine = KVBoost.from_pretrained(device="cpu", disk_cache_bytes=0, weights="float")
    assert engine.model.dtype == torch.float32 and engine.info().weights.num_int4_linears == 0
    return engine


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
