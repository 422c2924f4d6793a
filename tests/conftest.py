"""Shared fixtures. The real model (SmolLM2-135M-Instruct, embedded default) loads once per session."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def smollm():
    """KVBoost over the real default model with reuse="chunk". Tests that need another setting call
    `smollm.with_options(...)`, which shares the loaded weights and starts an empty store."""
    from engine import KVBoost

    return KVBoost.from_pretrained(device="cpu")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
