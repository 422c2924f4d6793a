"""The one hot loop: prefill a planned prompt, then decode token by token, as a generator of events.

The CLI, the server and the GUI all consume the same events: `TokenEvent` per visible text delta, then one
`Result` as the last event. Tokenization happens in the caller; this module only turns text deltas out of
token ids for streaming.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Iterator, Sequence

import torch
from transformers import DynamicCache

from .approx import blend_forward
from .assemble import APPROXIMATE, MISS, Plan, append_kv, slice_kv
from .paged import SpillingCache, kv_range, make_cache, spill_stats, spilling
from .rope import rerotate_kv
from .config import SamplingConfig
from .store import ChunkStore


@dataclass
class TokenEvent:
    text: str  # the visible text added by this step (may be "" while a multi-byte char or stop is pending)
    token_id: int


@dataclass
class Stats:
    prompt_tokens: int = 0
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    generated_tokens: int = 0
    ttft_ms: float = 0.0
    total_ms: float = 0.0
    decode_tokens_per_s: float = 0.0
    store_ms: float = 0.0  # storing chunk/tail KV, inside the call, after the first token
    repaired_tokens: int = 0  # reused tokens recomputed by seam repair (cacheblend, past the probe layer)
    repair: str = "none"
    spilled_tokens: int = 0  # live KV positions moved to host RAM (live_kv_bytes) by the end
    chunks: list[tuple[int, int, str]] = field(default_factory=list)
    reuse: str = "off"
    reused_by_tier: dict[str, int] = field(default_factory=dict)  # reused tokens per tier served from

    @property
    def reused_fraction(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["chunks"] = [list(c) for c in self.chunks]
        return d


@dataclass
class Result:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop string) | "length" | "cancelled"
    stats: Stats
    # Next-token logits [V] at the end of the prompt (float32, CPU); only with stream(..., return_logits=True).
    first_logits: torch.Tensor | None = None


class Cancelled(Exception):
    pass


def run_segments(model, plan: Plan, store: ChunkStore | None, cache: DynamicCache, device, rope=None,
                 repair=None, batch_repair: bool = True) -> tuple[torch.Tensor, int]:
    """Fills `cache` for the whole prompt following `plan`; returns the logits of the last prompt token [V] and
    the number of reused tokens that repair recomputed.

    Consecutive reuse segments are appended in one concatenation (APPROXIMATE ones re-rotated to their new
    positions first); each MISS run is one forward pass over the base model (no LM head), except the last,
    which computes logits for its last position only. With repair "cacheblend", everything from the first
    APPROXIMATE token on is one CacheBlend pass instead, and with "selective" one batched pass over every
    computed token after it (engine.approx.blend_forward).
    """
    segments = plan.segments
    assert segments and segments[-1].kind == MISS, "a plan ends with a computed token"
    # batch_repair: the model runs engine.approx.blend_forward (Llama-family layers, no sliding window).
    batched = repair is not None and (repair.mode == "cacheblend" or (repair.mode == "selective" and batch_repair))
    blend_from = plan.first_approximate if batched else len(plan.ids)
    decoder = model.get_decoder()
    i = 0
    logits = None
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
        input_ids = torch.tensor([plan.ids[start:end]], device=device)
        if i == len(segments):
            out = model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            logits = out.logits[0, -1]
        else:
            decoder(input_ids=input_ids, past_key_values=cache, use_cache=True)
    repaired = 0
    if i < len(segments):
        logits, repaired = _blend(model, plan, segments[i:], store, cache, rope, repair, device)
    assert cache.get_seq_length() == len(plan.ids), "cache covers the whole prompt"
    return logits, repaired


def _segment_kv(seg, store, rope, device):
    kv = _to_device(slice_kv(store.payload(seg.record.key), seg.offset, seg.offset + seg.num_tokens), device)
    if seg.kind == APPROXIMATE:
        kv = rerotate_kv(kv, seg.record.start + seg.offset, seg.start, rope)
    return kv


def _blend(model, plan, segments, store, cache, rope, repair, device):
    """Builds full-length per-layer K/V (exact prefix in `cache`, then cached KV of the reused segments and
    zeros where tokens are computed) and runs the CacheBlend pass over the rest of the prompt."""
    start = segments[0].start
    num_layers = model.config.num_hidden_layers
    reused = torch.zeros(len(plan.ids) - start, dtype=torch.bool, device=device)
    pieces = []
    for seg in segments:
        if seg.kind == MISS:
            pieces.append(None)
        else:
            pieces.append(_segment_kv(seg, store, rope, device))
            reused[seg.start - start:seg.end - start] = True
    layers_k, layers_v = [], []
    spilled = isinstance(cache, SpillingCache)
    prefix = kv_range(cache, 0, start) if spilled and start > 0 else None  # pages included
    for layer in range(num_layers):
        ks, vs = [], []
        if start > 0:
            ks.append(prefix[layer][0] if prefix else cache.layers[layer].keys)
            vs.append(prefix[layer][1] if prefix else cache.layers[layer].values)
        for seg, kv in zip(segments, pieces):
            if kv is None:
                ks.append(_zeros_kv(model, seg.num_tokens, device))
                vs.append(_zeros_kv(model, seg.num_tokens, device))
            else:
                ks.append(kv[layer][0])
                vs.append(kv[layer][1])
        layers_k.append(torch.cat(ks, dim=2).contiguous())
        layers_v.append(torch.cat(vs, dim=2).contiguous())
    logits = blend_forward(model, plan.ids, start, layers_k, layers_v, reused, repair, device)
    for layer in range(num_layers):
        if layer < len(cache.layers) and start > 0 and not spilled:
            cache.layers[layer].keys, cache.layers[layer].values = layers_k[layer], layers_v[layer]
        else:
            if layer < len(cache.layers) and start > 0:
                cache.layers[layer].reset()  # refilled whole below; the layer spills again by its budget
            cache.update(layers_k[layer], layers_v[layer], layer)
    repaired = int(round(repair.blend_ratio * int(reused.sum()))) if repair.mode == "cacheblend" else 0
    return logits, repaired


def _zeros_kv(model, num_tokens, device):
    """Placeholder K or V [1, H_kv, T, D] for tokens the blend pass computes (overwritten at every layer)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return torch.zeros(1, heads, num_tokens, head_dim, dtype=model.dtype, device=device)


def _to_device(kv, device):
    return tuple((k.to(device, non_blocking=True), v.to(device, non_blocking=True)) for k, v in kv)


def decode_one_token(model, token_id: int, cache: DynamicCache, device) -> torch.Tensor:
    with spilling(cache):  # one block per forward: nothing stays active across the generator's yields
        out = model(input_ids=torch.tensor([[token_id]], device=device), past_key_values=cache, use_cache=True)
    return out.logits[0, -1]


GREEDY_BELOW = 1e-30  # logits are tens at most: divided by 1e-30 they are still finite in float32


def sample(logits: torch.Tensor, params: SamplingConfig, history: Sequence[int],
           generator: torch.Generator | None) -> int:
    """One token from next-token logits [V]. temperature 0 is greedy, and so is any temperature below
    GREEDY_BELOW (its limit; logits / temperature would overflow float32). top_p keeps at least the top token.
    Works in float32 on the CPU so that the same seed gives the same token on every device."""
    logits = logits.detach().float().cpu()
    if params.repetition_penalty != 1.0 and len(history):
        seen = torch.tensor(sorted(set(history)), dtype=torch.long)
        scores = logits[seen]
        logits[seen] = torch.where(scores > 0, scores / params.repetition_penalty, scores * params.repetition_penalty)
    if params.temperature < GREEDY_BELOW:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= params.top_p  # keep the first over top_p
        drop[0] = False  # a top_p below float32's range compares as 0, which would drop them all
        logits[order[drop]] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


class Detokenizer:
    """Incremental text for streamed ids: decodes a short window so multi-token characters come out whole,
    and holds back text that could be the start of a stop string."""

    def __init__(self, tokenizer, stop: Sequence[str]):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.text = ""  # all text decoded so far
        self.emitted = 0  # characters of self.text already handed out
        self._prefix_offset = 0
        self._read_offset = 0
        self.stopped = False

    def _decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self._prefix_offset:self._read_offset])
        full = self._decode(self.ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.ids)
        return self._release()

    def _release(self) -> str:
        visible_end = len(self.text)
        for s in self.stop:
            hit = self.text.find(s, max(0, self.emitted - len(s) + 1))
            if hit != -1 and hit < visible_end:
                visible_end = hit
                self.stopped = True
        if not self.stopped:
            # Hold back a suffix that may grow into a stop string.
            for s in self.stop:
                for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                    if self.text.endswith(s[:k]):
                        visible_end = min(visible_end, len(self.text) - k)
                        break
        delta = self.text[self.emitted:visible_end] if visible_end > self.emitted else ""
        self.emitted = max(self.emitted, visible_end)
        if self.stopped:
            self.text = self.text[:visible_end]
        return delta

    def finish(self) -> str:
        """Everything held back, at the end of generation (a stop-string prefix that never completed)."""
        if self.stopped:
            return ""
        delta = self.text[self.emitted:]
        self.emitted = len(self.text)
        return delta


def generate_events(model, tokenizer, plan: Plan, store: ChunkStore | None, params: SamplingConfig, *,
                    device, eos_ids: set[int], max_context: int, t_enter: float, reuse: str,
                    cancel: threading.Event | None = None, rope=None, repair=None, batch_repair=True,
                    return_logits=False, reused_by_tier: dict[str, int] | None = None,
                    live_kv: tuple[int | None, int] = (None, 128),
                    on_prefilled=None, on_finished=None) -> Iterator[TokenEvent | Result]:
    """Prefill per `plan`, then sample up to max_new_tokens. `on_prefilled(cache)` runs right after the first
    token is out (storing new chunks); `on_finished(cache, all_ids)` runs however the loop ends, cancellation
    and consumer close included, so the store stays consistent."""
    stats = Stats(prompt_tokens=len(plan.ids), reused_tokens=plan.reused_tokens,
                  recomputed_tokens=len(plan.ids) - plan.reused_tokens, chunks=plan.chunk_rows(), reuse=reuse,
                  repair=repair.mode if repair is not None and plan.first_approximate < len(plan.ids) else "none",
                  reused_by_tier=dict(reused_by_tier or {}))
    generator = None
    if params.temperature > 0:
        generator = torch.Generator()
        generator.manual_seed(params.seed if params.seed is not None else int.from_bytes(os.urandom(7), "little"))
    detok = Detokenizer(tokenizer, params.stop)
    cache = make_cache(model, live_kv[0], page_tokens=live_kv[1])  # live_kv: (device bytes, page tokens)
    generated: list[int] = []
    finish_reason = "length"
    first_logits = None
    t_first = None
    prefill_stored = False
    try:
        with torch.inference_mode():
            with spilling(cache):
                logits, stats.repaired_tokens = run_segments(model, plan, store, cache, device, rope, repair,
                                                             batch_repair)
            first_logits = logits.float().cpu().clone() if return_logits else None
            while True:
                token = sample(logits, params, plan.ids + generated, generator)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if t_first is None:
                    t_first = time.perf_counter()
                    stats.ttft_ms = (t_first - t_enter) * 1000
                if token in eos_ids:
                    finish_reason = "stop"
                    break
                generated.append(token)
                delta = detok.add(token)
                if delta:
                    yield TokenEvent(delta, token)
                if not prefill_stored and on_prefilled is not None:
                    prefill_stored = True
                    t0 = time.perf_counter()
                    on_prefilled(cache)
                    stats.store_ms += (time.perf_counter() - t0) * 1000
                if detok.stopped:
                    finish_reason = "stop"
                    break
                if len(generated) >= params.max_new_tokens or len(plan.ids) + len(generated) >= max_context:
                    finish_reason = "length"
                    break
                if cancel is not None and cancel.is_set():
                    raise Cancelled
                logits = decode_one_token(model, token, cache, device)
    except Cancelled:
        finish_reason = "cancelled"
    finally:
        # Runs on normal end, on cancel, and when the consumer closes the stream (GeneratorExit).
        if on_finished is not None and cache.get_seq_length() >= len(plan.ids):
            t0 = time.perf_counter()
            if not prefill_stored and on_prefilled is not None:
                on_prefilled(cache)
            on_finished(cache, plan.ids + generated)
            stats.store_ms += (time.perf_counter() - t0) * 1000
    tail = detok.finish()
    if tail:
        yield TokenEvent(tail, generated[-1])
    t_end = time.perf_counter()
    stats.spilled_tokens = spill_stats(cache)["spilled_tokens"]
    stats.generated_tokens = len(generated)
    stats.total_ms = (t_end - t_enter) * 1000
    if t_first is not None and len(generated) > 1:
        stats.decode_tokens_per_s = (len(generated) - 1) / max(t_end - t_first, 1e-9)
    yield Result(detok.text, generated, finish_reason, stats, first_logits)

