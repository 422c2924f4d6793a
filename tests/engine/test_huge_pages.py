"""engine.weights.huge_pages: tensors carved out of huge-page-advised mappings, as torch.empty would give them,
and the GGUF loader holding a model's blocks there."""

from __future__ import annotations

import gc
import mmap
from pathlib import Path

import pytest
import torch
from gguf_files import tiny_gguf

from engine.weights import gguf_blocks, huge_pages
from engine.weights.loader import load_model, resolve_source


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


def huge_page_mode() -> str | None:
    """The system's transparent huge pages setting ("always", "madvise", "never"), or None where it has none."""
    try:
        setting = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return setting[setting.index("[") + 1:setting.index("]")]


def advised_for_huge_pages(address: int) -> bool:
    """Whether the mapping holding `address` may have huge pages (its THPeligible line in /proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "THPeligible:":
            return line.split()[1] == "1"
    return False


@pytest.mark.skipif(gguf_blocks.unavailable() is not None, reason="no block kernel here")
def test_the_blocks_a_decode_step_reads_whole_lie_in_memory_advised_for_huge_pages(tmp_path, one_thread):
    """Where the system gives huge pages only to memory that asks (its setting "madvise"), every weight held as
    blocks (the decoder's, the head's) lies in mappings that ask; a mapping that did not ask is not eligible (the
    control: a fresh one, since a torch allocation lands wherever the process's allocator has room, and once, after
    the whole suite had run in one process, one read as eligible)."""
    if huge_page_mode() != "madvise":
        pytest.skip(f"transparent huge pages here: {huge_page_mode()} (only 'madvise' tells asking memory apart)")
    path = tiny_gguf(tmp_path / "llama-q4_1.gguf", "Q4_1", table_type="Q4_1")
    model = load_model(resolve_source(str(path)), torch.device("cpu"), torch.float32, weights="int4",
                       kernel=gguf_blocks.KERNEL)[0]
    held = [m for m in model.modules() if isinstance(m, gguf_blocks.BlockLinear)]
    assert len(held) == 15 and all(advised_for_huge_pages(m.blocks.data_ptr()) for m in held)
    plain = torch.frombuffer(mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8)
    assert not advised_for_huge_pages(plain.data_ptr() + (4 << 20))
