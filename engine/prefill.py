"""Building the cache of a prompt from its plan: reused KV appended, computed runs forwarded, the blend pass.

Consecutive reuse segments are appended in one concatenation (APPROXIMATE ones re-rotated to their new positions
first); each MISS run is one forward pass over the base model (no LM head), except the last, which computes
logits for its last position only. With repair "cacheblend", everything from the first APPROXIMATE token on is
one CacheBlend pass instead, and with "selective" one batched pass over every computed token after it
(engine.blend), where the model's layers allow it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .batching import Forward
from .blend import blend
from .block_forward import OneCallForward
from .kv.store import ChunkStore
from .live_cache import GrowingCache
from .paged import KV, spilling
from .plan import APPROXIMATE, MISS, Plan, Segment
from .rope import rerotate_kv


@dataclass(frozen=True)
class PromptProgress:
    """A long prompt being read (KVBoost.stream(progress=True)): `done` of its `total` tokens are in the cache, reused
    or computed; one after each computed piece but the last, before the first TokenEvent."""

    done: int
    total: int


def prefill(model, plan: Plan, store: ChunkStore | None, cache: DynamicCache, device, rope=None, repair=None,
            batch_repair: bool = True, piece_tokens: int | None = None) -> tuple[torch.Tensor, int]:
    """Fills `cache` for the whole prompt following `plan`; returns the logits of the last prompt token [V] and
    the number of reused tokens that repair recomputed. `batch_repair`: the model can run the batched pass
    (engine.blend.blend_unavailable is None), so selective repair runs as one pass rather than one per seam.
    `piece_tokens`: computed runs are cut at multiples of it (prefill_steps)."""
    steps = prefill_steps(model, plan, store, cache, device, rope, repair, batch_repair, piece_tokens)
    sent = None
    while True:
        try:
            piece = steps.send(sent)
        except StopIteration as done:
            return done.value
        sent = prompt_forward(model, piece, device)


@torch.inference_mode()
def prefill_steps(model, plan: Plan, store: ChunkStore | None, cache: DynamicCache, device, rope=None, repair=None,
                  batch_repair: bool = True, piece_tokens: int | None = None, timing: list | None = None,
                  progress: bool = False):
    """prefill() as a coroutine that yields each computed piece as a batching.Forward (prompt=True) for whoever
    runs the request (alone, or a Batch, which takes one piece per step) and gets its logits back; returns
    (logits, repaired). Computed runs are forwarded in pieces that end at multiples of `piece_tokens` (None: each
    run in one pass): the same cuts whether the request runs alone or batched, so its KV is the same either way.
    `timing`, when given, receives (tokens, seconds) of each computed piece (the work itself: no fetch, no
    overhead; on CUDA up to a synchronize; in a batch's pass, the piece's share of it), from which a front end
    learns what a token of prefill costs on this machine. `progress`: a PromptProgress after each computed piece
    but the last (whoever runs the request hands it on and sends nothing back)."""
    segments = plan.segments
    assert segments and segments[-1].kind == MISS, "a plan ends with a computed token"
    batched = repair is not None and (repair.mode == "cacheblend" or (repair.mode == "selective" and batch_repair))
    blend_from = plan.first_approximate if batched else len(plan.ids)
    i = 0
    logits = None
    repaired = 0
    with spilling(cache):  # a SpillingCache pages its cold KV out as it fills; a no-op for any other cache
        while i < len(segments) and segments[i].start < blend_from:
            if segments[i].kind != MISS:
                parts = []
                while i < len(segments) and segments[i].kind != MISS and segments[i].start < blend_from:
                    parts.append(_segment_kv(segments[i], store, rope, device))
                    i += 1
                append_kv(cache, parts)
                continue
            start = segments[i].start
            while i < len(segments) and segments[i].kind == MISS and segments[i].start < blend_from:
                i += 1
            end = segments[i - 1].end
            last_run = i == len(segments)
            for piece_start, piece_end in _pieces(start, end, piece_tokens):
                final = last_run and piece_end == end
                piece = Forward(plan.ids[piece_start:piece_end], cache, prompt=True, keep=1 if final else 0)
                out = yield piece  # whoever runs the request runs the piece (alone, or in a batch's pass)
                if timing is not None:
                    timing.append((piece_end - piece_start, piece.seconds))
                if final:
                    logits = out[-1]
                elif progress:
                    yield PromptProgress(piece_end, len(plan.ids))
        if i < len(segments):
            rest = segments[i:]
            pieces = [None if seg.kind == MISS else _segment_kv(seg, store, rope, device) for seg in rest]
            logits, repaired = blend(model, plan.ids, rest, pieces, cache, repair, device)
    assert cache.get_seq_length() == len(plan.ids), "cache covers the whole prompt"
    return logits, repaired


@torch.inference_mode()
def prompt_forward(model, forward: Forward, device) -> torch.Tensor | None:
    """A prefill piece run by itself: the logits of its last `keep` tokens [keep, V], or None for keep 0 (the
    layers alone, no head: in one C call where the model is in GGUF blocks). Its time goes to forward.seconds."""
    began = time.perf_counter()
    input_ids = torch.tensor([forward.tokens], device=device)
    logits = None
    if forward.keep:
        out = model(input_ids=input_ids, past_key_values=forward.cache, use_cache=True, logits_to_keep=forward.keep)
        logits = out.logits[0]
    elif not (isinstance(getattr(model, "forward", None), OneCallForward)
              and model.forward.layers_only(input_ids, forward.cache)):
        model.get_decoder()(input_ids=input_ids, past_key_values=forward.cache, use_cache=True)
    if input_ids.device.type == "cuda":
        torch.cuda.synchronize(input_ids.device)
    forward.seconds = time.perf_counter() - began
    return logits


def _pieces(start: int, end: int, piece_tokens: int | None):
    """[start, end) cut at the multiples of piece_tokens inside it."""
    if not piece_tokens:
        yield start, end
        return
    while start < end:
        cut = min(end, (start // piece_tokens + 1) * piece_tokens)
        yield start, cut
        start = cut


def _segment_kv(seg: Segment, store: ChunkStore, rope, device) -> KV:
    """The KV a reuse segment serves, on `device`, at the segment's positions."""
    kv = _to_device(slice_kv(store.payload(seg.record.key), seg.offset, seg.offset + seg.num_tokens), device)
    if seg.kind == APPROXIMATE:
        kv = rerotate_kv(kv, seg.record.start + seg.offset, seg.start, rope)
    return kv


def _to_device(kv: KV, device) -> KV:
    return tuple((k.to(device, non_blocking=True), v.to(device, non_blocking=True)) for k, v in kv)


def slice_kv(kv: KV, start: int, end: int) -> KV:
    """Positions [start, end) of every layer (views, no copy)."""
    return tuple((k[:, :, start:end], v[:, :, start:end]) for k, v in kv)


def append_kv(cache: DynamicCache, parts: list[KV]) -> None:
    """Appends the KV of consecutive reuse segments to every layer of `cache`, several concatenated per layer (one
    as it is: the cache copies it in; concatenating it first was a second copy of every layer)."""
    kv = parts[0] if len(parts) == 1 else tuple(
        (torch.cat([p[layer][0] for p in parts], dim=2), torch.cat([p[layer][1] for p in parts], dim=2))
        for layer in range(len(parts[0])))
    if type(cache) is GrowingCache:
        cache.append(kv)
        return
    for layer, (keys, values) in enumerate(kv):
        cache.update(keys, values, layer)
