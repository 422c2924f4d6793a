"""Segments and plans: which token ranges of a prompt are reused from which store entry, and which are computed.

A plan is a list of segments covering [0, n) in order. A reuse segment takes KV from a store entry
(EXACT: a chunk under its chained key; PREFIX: the longest common token prefix of a tail or of a chunk whose
text went on differently, hung under the same parent, or, in "prefix" mode, the leading run of chunks);
APPROXIMATE segments come from engine.approx; a MISS segment is computed by a forward pass over its tokens with
every earlier segment already in the cache, so its KV is the KV of a real prefill in its true context.

Planning is bookkeeping only: it reads records, never tensors (engine.prefill builds the cache from a plan).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, Sequence

from .chunking import Span
from .keys import chain_key

if TYPE_CHECKING:  # records are only read here, never built
    from .kv.records import ChunkRecord


class ChunkLookup(Protocol):
    """What planning reads of a store: records by key and by relation, never payloads (engine.kv.store.ChunkStore
    is one)."""

    def record(self, key: bytes) -> ChunkRecord | None:
        """The entry under `key` (any kind), or None."""

    def get_chunk(self, key: bytes) -> ChunkRecord | None:
        """The exact chunk under `key`, or None."""

    def children(self, parent: bytes) -> list[ChunkRecord]:
        """The chunks stored right after `parent`."""

    def anchored(self, tokens: tuple[int, ...]) -> list[tuple[ChunkRecord, int]]:
        """(chunk, offset) wherever a chunk holds these anchor tokens."""

EXACT, PREFIX, APPROXIMATE, MISS = "EXACT", "PREFIX", "APPROXIMATE", "MISS"
# An EXACT or PREFIX hit whose KV values are not the computed ones (served from a quantized tier, or computed over
# quantized KV): the text before it is the same, the numbers are not, so it is never reported as EXACT.
QUANTIZED = "QUANTIZED"


@dataclass
class Segment:
    start: int
    end: int
    kind: str
    record: ChunkRecord | None = None  # the entry reused (None for MISS)
    offset: int = 0  # first token of the entry used (a tail's LCP starts at 0)

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass
class Plan:
    ids: list[int]
    spans: list[Span]
    num_complete: int
    keys: list[bytes]  # chained key of each complete span
    root: bytes
    segments: list[Segment] = field(default_factory=list)

    @property
    def reused_tokens(self) -> int:
        return sum(s.num_tokens for s in self.segments if s.kind != MISS)

    @property
    def first_approximate(self) -> int:
        """Position of the first APPROXIMATE token (len(ids) if none): KV from there on is not exact."""
        return min((s.start for s in self.segments if s.kind == APPROXIMATE), default=len(self.ids))

    @property
    def first_lossy(self) -> int:
        """Position of the first QUANTIZED token: KV from there on (the answer's too) is not the computed KV.
        Past any position (sys.maxsize) when there is none."""
        return min((s.start for s in self.segments if s.kind == QUANTIZED), default=sys.maxsize)

    @property
    def tail_start(self) -> int:
        return self.spans[self.num_complete - 1][1] if self.num_complete else 0

    @property
    def tail_parent(self) -> bytes:
        return self.keys[self.num_complete - 1] if self.num_complete else self.root

    def parent_of(self, span_index: int) -> bytes:
        return self.keys[span_index - 1] if span_index else self.root

    def chunk_rows(self) -> list[tuple[int, int, str]]:
        return [(s.start, s.end, s.kind) for s in self.segments]


def chain_keys(ids: Sequence[int], spans: Sequence[Span], num_complete: int, root: bytes) -> list[bytes]:
    keys, parent = [], root
    for start, end in spans[:num_complete]:
        parent = chain_key(parent, ids[start:end])
        keys.append(parent)
    return keys


def _longest_common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _best_child(store: ChunkLookup, parent: bytes, rest: Sequence[int]) -> tuple[ChunkRecord | None, int]:
    """Among the exact entries stored right after `parent` (tails, and chunks whose text went on differently),
    the one sharing the longest token prefix with `rest`, and that length: token-granular reuse, as a radix
    tree would give."""
    best, best_len = None, 0
    for child in store.children(parent):
        if not child.exact:
            continue
        common = _longest_common_prefix(child.tokens, rest)
        if common > best_len:
            best, best_len = child, common
    return best, best_len


def plan_prompt(ids: list[int], spans: list[Span], num_complete: int, root: bytes, store: ChunkLookup | None,
                mode: str, refine=None) -> Plan:
    """Decides, per token range, whether it is reused or computed. mode: "off" | "prefix" | "chunk".
    `refine(segments)` (optional) may turn parts of MISS segments into other kinds (APPROXIMATE reuse)."""
    keys = chain_keys(ids, spans, num_complete, root)
    plan = Plan(ids, spans, num_complete, keys, root)
    n = len(ids)
    segments: list[Segment] = []
    pos = 0
    if mode != "off" and store is not None:
        # Walk the chunk boundaries in order. At each one the tokens before it are known (chained key), so a
        # chunk stored under that key, or a tail hung under it, is exact here. "prefix" stops at the first
        # boundary with neither; "chunk" computes that chunk and goes on looking.
        index = 0
        while index <= num_complete:
            boundary = spans[index][0] if index < len(spans) else n
            if boundary >= n:
                break
            if pos > boundary:  # a tail already covered this boundary
                index += 1
                continue
            hit = store.get_chunk(keys[index]) if index < num_complete else None
            partial, common = (None, 0) if hit else _best_child(store, plan.parent_of(index), ids[boundary:])
            if (hit or partial) and pos < boundary:
                segments.append(Segment(pos, boundary, MISS))
                pos = boundary
            if hit:
                segments.append(Segment(boundary, spans[index][1], EXACT if mode == "chunk" else PREFIX, hit))
                pos = spans[index][1]
            elif partial:
                segments.append(Segment(pos, pos + common, PREFIX, partial))
                pos += common
            if not hit and mode == "prefix":
                break
            index += 1
    if pos < n:
        segments.append(Segment(pos, n, MISS))
    if refine is not None:
        segments = refine(segments)
    _leave_last_token_to_compute(segments, n)
    plan.segments = _split_misses_at_spans(segments, spans)
    return plan


def _leave_last_token_to_compute(segments: list[Segment], n: int) -> None:
    """The next-token logits come from a forward pass over at least the last prompt token."""
    last = segments[-1]
    if last.kind == MISS:
        return
    if last.num_tokens == 1:
        last.kind, last.record, last.offset = MISS, None, 0
        return
    last.end -= 1  # a reuse segment keeps its offset: it just ends one token earlier
    segments.append(Segment(n - 1, n, MISS))


def _split_misses_at_spans(segments: list[Segment], spans: list[Span]) -> list[Segment]:
    """One row per chunk for the UI: MISS segments are cut at chunk boundaries (reuse segments already are
    chunk-sized, or a tail's prefix)."""
    cuts = sorted({end for _, end in spans})
    out: list[Segment] = []
    for seg in segments:
        if seg.kind != MISS:
            out.append(seg)
            continue
        start = seg.start
        for cut in cuts:
            if start < cut < seg.end:
                out.append(Segment(start, cut, MISS))
                start = cut
        out.append(Segment(start, seg.end, MISS))
    return out
