"""APPROXIMATE reuse: finding cached text wherever it sits in a prompt, and repairing the seams.

Lookup is alignment-free. Every stored chunk is indexed by anchors (its tokens at offsets 0, 16, 32, ...).
The planner scans each not-yet-covered range of the prompt position by position, looks the next 16 tokens up
among the anchors, and extends every candidate backwards and forwards while tokens agree. A document warmed
alone, or seen in an earlier prompt, is therefore found at any offset, after any preamble, between any
neighbours, and whatever the chunk cuts were in either prompt. Only the tokens that really match are reused
(a document whose first token merged differently with its new neighbour loses that token, not its chunk).

A reused run's keys are re-rotated exactly from their stored positions to the new ones (engine.rope). Its
KV still carries the context it was computed in (other neighbours, or none); repair recomputes part of it in
the true context:
- selective: the first `selective_tokens` tokens after every seam (where reused text starts after something
  it did not follow before), and optionally the last `selective_before` reused tokens before it, in full
  context, at the cost of those tokens only.
- cacheblend: one batched pass over everything after the first APPROXIMATE token. The first layers run for
  every token; at the probe layer each reused token's fresh value is compared with its cached value, and only
  the `blend_ratio` most deviating reused tokens (plus every computed token) go on through the remaining
  layers, attending to a cache that mixes their fresh KV with everyone else's cached KV.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .assemble import APPROXIMATE, MISS, Segment
from .config import RepairConfig
from .rope import can_rerotate
from .store import ANCHOR_LEN, ChunkStore

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


def fill_approximate(segments: list[Segment], ids: Sequence[int], store: ChunkStore, rope,
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
        parent = store.records.get(record.parent)
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


class BlendCache:
    """The cache the decoder layers see during a CacheBlend pass.

    For layer l it holds K/V for every prompt position: the exact prefix, then the cached (re-rotated) KV of
    the blended range. `update` writes the active tokens' fresh K/V over their positions and returns the whole
    K/V, so the active queries attend to a mix of fresh and cached KV. At the probe layer it first records how
    far each active token's fresh value is from its cached value."""

    def __init__(self, layers_k: list[torch.Tensor], layers_v: list[torch.Tensor], offset: int):
        self.keys = layers_k  # per layer [1, H_kv, n, D]
        self.values = layers_v
        self.offset = offset  # first position of the blended range
        self.active: torch.Tensor | None = None  # positions of the active tokens [A]
        self.probe_layer = -1
        self.deviation: torch.Tensor | None = None  # [A] at the probe layer

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.keys[layer_idx], self.values[layer_idx]
        if layer_idx == self.probe_layer:
            cached = v[:, :, self.active]  # [1, H_kv, A, D]
            self.deviation = (value_states - cached).float().norm(dim=-1).mean(dim=(0, 1))
        k[:, :, self.active] = key_states
        v[:, :, self.active] = value_states
        return k, v


def blend_forward(model, ids: Sequence[int], start: int, layers_k, layers_v, reused: torch.Tensor,
                  repair: RepairConfig, device) -> torch.Tensor:
    """One batched pass over positions [start, n): `layers_k/v` hold per layer the full-length KV (the exact
    prefix [0, start) and cached KV where `reused` [n - start] is True; anything elsewhere is overwritten).
    cacheblend: every token through the layers up to the probe, then the computed tokens and the most deviating
    reused ones. selective: the computed tokens (seams and new text) alone through every layer, which equals
    computing them one run at a time but costs one forward pass instead of one per seam. Returns the last
    position's logits [V]; `layers_k/v` end up as the cache to decode from."""
    decoder = model.get_decoder()
    n = len(ids)
    positions = torch.arange(start, n, device=device)
    hidden = decoder.embed_tokens(torch.tensor([ids[start:]], device=device))
    cache = BlendCache(layers_k, layers_v, start)
    cache.active = positions
    num_reused = int(reused.sum())
    probe_layer = repair.probe_layer if repair.mode == "cacheblend" else -1
    cache.probe_layer = probe_layer
    if probe_layer < 0:  # selective: only the computed tokens, through every layer
        keep = torch.nonzero(~reused).squeeze(1)
        hidden = hidden[:, keep]
        cache.active = positions[keep]
    for layer_idx, layer in enumerate(decoder.layers[: model.config.num_hidden_layers]):
        if layer_idx == probe_layer + 1 and probe_layer >= 0:
            keep = _select(cache.deviation, reused, repair.blend_ratio, num_reused)
            hidden = hidden[:, keep]
            cache.active = positions[keep]
        active = cache.active
        # Query at position p sees every key at a position <= p.
        mask = (torch.arange(n, device=device)[None, :] <= active[:, None])[None, None]
        cos_sin = decoder.rotary_emb(hidden, active[None])
        hidden = layer(hidden, attention_mask=mask, position_ids=active[None], past_key_values=cache,
                       use_cache=True, position_embeddings=cos_sin)
    hidden = decoder.norm(hidden[:, -1:])
    return model.lm_head(hidden)[0, -1]


def _select(deviation: torch.Tensor, reused: torch.Tensor, ratio: float, num_reused: int) -> torch.Tensor:
    """Indices (into the blended range, sorted) of every computed token plus the `ratio` most deviating
    reused tokens. The last token is always computed (it is never reused)."""
    num_keep = int(round(ratio * num_reused))
    score = deviation.masked_fill(~reused, float("inf"))
    keep = torch.topk(score, int((~reused).sum()) + num_keep).indices
    return torch.sort(keep).values


BLEND_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "granite", "olmo2", "smollm3"})
