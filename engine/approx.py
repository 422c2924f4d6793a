"""APPROXIMATE reuse: finding cached text wherever it sits in a prompt, and choosing the seams to repair.

Lookup is alignment-free. Every stored chunk is indexed by anchors (its tokens at offsets 0, 16, 32, ...).
The planner scans each not-yet-covered range of the prompt position by position, looks the next 16 tokens up
among the anchors, and extends every candidate backwards and forwards while tokens agree. A document warmed
alone, or seen in an earlier prompt, is therefore found at any offset, after any preamble, between any
neighbours, and whatever the chunk cuts were in either prompt. Only the tokens that really match are reused
(a document whose first token merged differently with its new neighbour loses that token, not its chunk).

A reused run's keys are re-rotated exactly from their stored positions to the new ones (engine.rope). Its
KV still carries the context it was computed in (other neighbours, or none); repair recomputes part of it in
the true context. Selective repair is decided here, in the plan: the first `selective_tokens` tokens after
every seam (where reused text starts after something it did not follow before), and optionally the last
`selective_before` reused tokens before it, become MISS segments, computed in full context at the cost of
those tokens only. CacheBlend repair is a forward pass, not a plan (engine.blend).
"""

from __future__ import annotations

from typing import Sequence

from .kv.store import ANCHOR_LEN
from .plan import APPROXIMATE, MISS, ChunkLookup, Segment
from .rope import can_rerotate

# Shorter shared runs are not worth a re-rotation (and are mostly common phrases, not reused documents).
MIN_APPROX_TOKENS = 16


def merge_misses(segments: list[Segment]) -> list[Segment]:
    """Adjacent MISS segments as one, so approximate matches are not cut at chunk boundaries."""
    out: list[Segment] = []
    for seg in segments:
        if out and seg.kind == MISS and out[-1].kind == MISS and out[-1].end == seg.start:
            out[-1] = Segment(out[-1].start, seg.end, MISS)
        else:
            out.append(seg)
    return out


def fill_approximate(segments: list[Segment], ids: Sequence[int], store: ChunkLookup, rope,
                     min_tokens: int = MIN_APPROX_TOKENS) -> list[Segment]:
    """Replaces parts of MISS segments by APPROXIMATE segments where stored chunks hold the same tokens."""
    out: list[Segment] = []
    n = len(ids)
    for seg in segments:
        if seg.kind != MISS:
            out.append(seg)
            continue
        cursor, i = seg.start, seg.start
        while i + ANCHOR_LEN <= seg.end:
            best = _best_match(ids, i, cursor, seg.end, store, rope, n)
            if best is None or best[1] - best[0] < min_tokens:
                i += 1
                continue
            start, end, record, offset = best
            run = _extend_into_parents(ids, cursor, start, record, offset, store)
            run.append(Segment(start, end, APPROXIMATE, record, offset))
            run += _extend_into_children(ids, end, seg.end, record, offset + (end - start), store)
            if run[0].start > cursor:
                out.append(Segment(cursor, run[0].start, MISS))
            out.extend(run)
            cursor = i = run[-1].end
        if cursor < seg.end:
            out.append(Segment(cursor, seg.end, MISS))
    return out


def _best_match(ids, i, lo, hi, store, rope, n):
    """The longest run around position i shared with a stored chunk: (start, end, record, offset)."""
    best = None
    for record, anchor in store.anchored(tuple(ids[i:i + ANCHOR_LEN])):
        if rope is not None and not can_rerotate(rope, record.start + record.num_tokens, n):
            continue
        back = 0
        while i - back > lo and anchor - back > 0 and ids[i - back - 1] == record.tokens[anchor - back - 1]:
            back += 1
        fwd = ANCHOR_LEN
        while i + fwd < hi and anchor + fwd < record.num_tokens and ids[i + fwd] == record.tokens[anchor + fwd]:
            fwd += 1
        candidate = (i - back, i + fwd, record, anchor - back)
        if best is None or (fwd + back, record.exact) > (best[1] - best[0], best[2].exact):
            best = candidate
    return best


def _extend_into_parents(ids, lo, start, record, offset, store) -> list[Segment]:
    """When a match starts at the first token of its chunk, the text before it may continue in the chunk
    stored before that one (its parent, contiguous in the same source): extend backwards through parents
    while tokens agree. Returns the extra segments, in prompt order."""
    found: list[Segment] = []
    while offset == 0 and start > lo:
        parent = store.record(record.parent)
        if parent is None or parent.kind != "chunk" or parent.start + parent.num_tokens != record.start:
            break
        back = 0
        while (start - back > lo and back < parent.num_tokens
               and ids[start - back - 1] == parent.tokens[parent.num_tokens - back - 1]):
            back += 1
        if back == 0:
            break
        record, offset, start = parent, parent.num_tokens - back, start - back
        found.append(Segment(start, start + back, APPROXIMATE, record, offset))
    found.reverse()
    return found


def _extend_into_children(ids, end, hi, record, used, store) -> list[Segment]:
    """When a match runs to the last token of its entry, the text may go on in an entry stored right after
    it (a chunk or tail whose parent it is): extend forwards while tokens agree, through the child that
    agrees longest. `used` is how far into `record` the match reached."""
    found: list[Segment] = []
    while used == record.num_tokens and end < hi:
        best, best_len = None, 0
        for child in store.children(record.key):
            if child.start != record.start + record.num_tokens:
                continue
            length = 0
            while end + length < hi and length < child.num_tokens and ids[end + length] == child.tokens[length]:
                length += 1
            if length > best_len:
                best, best_len = child, length
        if best is None:
            break
        found.append(Segment(end, end + best_len, APPROXIMATE, best, 0))
        record, used, end = best, best_len, end + best_len
    return found


def is_seam(previous: Segment | None, seg: Segment) -> bool:
    """Whether APPROXIMATE `seg` starts where its text did not continue the previous segment's text when it
    was computed: a run continuing the same source across a chunk boundary is no seam."""
    if previous is None or previous.kind != APPROXIMATE:
        return True
    prev_source_end = previous.record.start + previous.offset + previous.num_tokens
    return prev_source_end != seg.record.start + seg.offset


def apply_selective(segments: list[Segment], after: int, before: int = 0) -> list[Segment]:
    """Turns the first `after` tokens after each seam, and the last `before` reused tokens before it, into
    MISS (computed in full context)."""
    seams = [seg.start for prev, seg in zip([None] + segments[:-1], segments)
             if seg.kind == APPROXIMATE and is_seam(prev, seg)]
    recompute = [(s - before, s + after) for s in seams]
    out: list[Segment] = []
    for seg in segments:
        if seg.kind != APPROXIMATE:
            out.append(seg)
            continue
        pos = seg.start
        for lo, hi in recompute:
            lo, hi = max(lo, pos), min(hi, seg.end)
            if lo >= hi:
                continue
            if lo > pos:
                out.append(Segment(pos, lo, APPROXIMATE, seg.record, seg.offset + (pos - seg.start)))
            out.append(Segment(lo, hi, MISS))
            pos = hi
        if pos < seg.end:
            out.append(Segment(pos, seg.end, APPROXIMATE, seg.record, seg.offset + (pos - seg.start)))
    return merge_misses(out)
