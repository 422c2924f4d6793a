"""engine.weights.huge_pages: tensors carved out of huge-page-advised mappings, as torch.empty would give them."""

from __future__ import annotations

import gc

import pytest
import torch

from engine.weights import huge_pages


@pytest.mark.skipif(not huge_pages.available(), reason="no anonymous mappings with madvise here")
def test_tensors_are_aligned_apart_writable_and_outlive_the_arena(monkeypatch):
    monkeypatch.setattr(huge_pages, "CHUNK", 4 << 20)  # small mappings: the second tensor opens a new one
    arena = huge_pages.HugePageArena()
    first, second = arena.empty(3, 1000), arena.empty(5, 77)
    big = arena.empty(2, 3 << 20)  # more than a mapping's least size: a mapping of its own
    assert first.shape == (3, 1000) and second.shape == (5, 77) and big.shape == (2, 3 << 20)
    assert all(t.dtype == torch.uint8 and t.is_contiguous() and t.data_ptr() % 64 == 0 for t in (first, second, big))
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel()) for t in (first, second, big))
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # no two overlap
    assert arena.mapped >= (4 << 20) + (6 << 20)
    first.fill_(1), second.fill_(2), big.fill_(3)
    del arena
    gc.collect()
    assert int(first.sum()) == 3000 and int(second.sum()) == 2 * 5 * 77 and int(big[1, -1]) == 3

