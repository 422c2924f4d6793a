"""Host memory for the weights a decode step reads whole (the block kernel's GGUF blocks), in large anonymous
mappings the kernel is asked to back with 2 MB pages (madvise MADV_HUGEPAGE, Linux).

A decode step streams every weight once. In 4 KB pages that is one TLB entry per 4 KB, far more than the TLB
holds (the embedded model reads ~93 MB a step: ~24k pages), and the kernels' prefetches ahead of the block being
multiplied do not cross into a page the TLB does not hold. Where the system grants huge pages only to memory that
asks for them (/sys/kernel/mm/transparent_hugepage/enabled: "madvise", the common default), torch's allocations
never get them. Measured on the embedded model in int4 (2-vCPU EPYC, the same process alternating the two copies
of the weights, medians of 6-12 rounds of the eight-question batching benchmark): one request at a time
0.92-0.93x the time (two runs), eight batched 0.98x.

Tensors are carved one after another out of mappings of at least CHUNK bytes, each starting on a 2 MB boundary,
64-byte aligned. A tensor keeps its mapping alive (torch.frombuffer holds it). Where the platform has no such
mapping (not Linux, mmap refused), `empty` is torch.empty.
"""

from __future__ import annotations

import mmap

import torch

HUGE = 2 << 20  # a huge page
CHUNK = 256 << 20  # a mapping's least size: a 7B model's ~4 GB in ~16 (each may leave part of a 2 MB page unused)
ALIGN = 64


def available() -> bool:
    """Whether this platform can map memory and advise huge pages for it (the system may still grant none)."""
    return all(hasattr(mmap, name) for name in ("MAP_PRIVATE", "MAP_ANONYMOUS", "MADV_HUGEPAGE"))


class HugePageArena:
    """uint8 tensors carved out of huge-page-advised anonymous mappings, for one model's weights."""

    def __init__(self):
        self._mapping: torch.Tensor | None = None  # the current mapping's bytes, from its 2 MB boundary
        self._used = 0
        self.mapped = 0  # bytes mapped so far (virtual; pages are touched as tensors are written)

    def empty(self, rows: int, row_bytes: int) -> torch.Tensor:
        """An uninitialised uint8 [rows, row_bytes] tensor in huge-page-advised memory (or torch.empty)."""
        size = rows * row_bytes
        if size <= 0 or not available():
            return torch.empty(rows, row_bytes, dtype=torch.uint8)
        if self._mapping is None or self._used + size > self._mapping.numel():
            if not self._map(size):
                return torch.empty(rows, row_bytes, dtype=torch.uint8)
        at = self._used
        self._used = -(-(at + size) // ALIGN) * ALIGN
        return self._mapping[at:at + size].view(rows, row_bytes)

    def _map(self, size: int) -> bool:
        length = max(CHUNK, -(-size // HUGE) * HUGE)
        try:
            area = mmap.mmap(-1, length + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except (OSError, ValueError):
            return False
        whole = torch.frombuffer(area, dtype=torch.uint8)  # keeps `area` alive while a tensor of it lives
        start = -whole.data_ptr() % HUGE
        try:
            area.madvise(mmap.MADV_HUGEPAGE, start, length)
        except OSError:
            pass  # the system lends no huge pages: ordinary pages, the same memory
        self._mapping, self._used = whole[start:start + length], 0
        self.mapped += length
        return True
