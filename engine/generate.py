"""The decode loop: sample, detokenize, and decode token by token over a filled cache, as a generator of events.

The CLI, the server and the GUI all consume the same events: `TokenEvent` per visible text delta, then one
`Result` as the last event. Tokenization happens in the caller, and so does building the prompt's cache
(engine.prefill) and storing what it computed (engine.reuse): this module only samples, feeds tokens back and
turns token ids into text deltas for streaming.

Logits are checked for NaN and infinity before every choice (`check_finite`): a model whose weights are damaged
answers with them, and no token can be chosen from them. Asked for (SamplingConfig.logprobs), each answer token's
log-probability comes with its event: the log-softmax of the model's raw logits at the token's position, before the
repetition penalty and the temperature, as OpenAI and vLLM report it by default.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, ClassVar, Generator, Sequence

import numpy as np
import torch
from transformers import DynamicCache

from .batching import Forward
from .block_forward import uses_block_forward
from .config import SamplingConfig
from .draft_model import DraftModel
from .paged import SpillingCache, rowwise_attention, spill_stats, spill_unsupported, spilling
from .sampling import is_greedy, sample, sampling_probs
from .speculative import DEFAULT_NUM_DRAFT, NgramIndex, draft_limit, verify


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model's raw logits, and (for an answer token) the likeliest tokens at
    its position, most likely first (ties: the lower id first)."""

    token_id: int
    text: str  # the token decoded by itself, special tokens spelled out (part of a multi-byte character: U+FFFD)
    logprob: float
    top: tuple["TokenLogprob", ...] = ()


@dataclass
class TokenEvent:
    text: str  # the visible text added by this step (may be "" while a multi-byte char or stop is pending)
    token_id: int
    # With SamplingConfig.logprobs: the answer tokens handed out since the previous event, in order (a token whose
    # text is held back, a piece of a character or of a possible stop string, comes with the event that shows it).
    logprobs: list[TokenLogprob] | None = None


@dataclass
class Stats:
    prompt_tokens: int = 0
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    prefill_ms: float = 0.0  # the computed prompt tokens' forward passes alone (no fetch, no overhead)
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
    weight_passes: int = 0  # with layer streaming: forwards through the streamed layers (each copies them once)
    tokens_per_weight_pass: float = 0.0  # tokens those passes computed, per pass (prefill: the prompt in one)
    decode_forwards: int = 0  # forwards of the decode loop (each feeds one token, and the drafts checked with it)
    drafted_tokens: int = 0  # speculative decoding: tokens drafted from the context ...
    accepted_tokens: int = 0  # ... and those the model agreed with (kept without a forward of their own)
    batched_forwards: int = 0  # decode forwards shared with other requests (engine.batching)

    @property
    def reused_fraction(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["chunks"] = [list(c) for c in self.chunks]
        return d


@dataclass
class Result:
    ends_request: ClassVar[bool] = True  # the last event of a request: a RequestStream frees the engine on it
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop string) | "length" | "cancelled"
    stats: Stats
    # Next-token logits [V] at the end of the prompt (float32, CPU); only with stream(..., return_logits=True).
    first_logits: torch.Tensor | None = None
    logprobs: list[TokenLogprob] | None = None  # with SamplingConfig.logprobs: one per token of token_ids


class Cancelled(Exception):
    """A cancel event was set: a generation ends at the next token (finish_reason "cancelled"), a model load
    (KVBoost.from_pretrained) before its next stage."""


class NonFiniteLogits(RuntimeError):
    """The model's logits hold NaN or infinity: its weights, or the file they came from, are damaged. Not the
    request's fault: the same prompt on a sound model answers."""


def check_finite(logits: torch.Tensor, where: str) -> None:
    """Raises NonFiniteLogits where `logits` [..., V] hold NaN or +infinity, or a row holds no finite value: no
    distribution comes from them. -infinity alone is a token ruled out (a model or a logits processor masking it),
    not damage. On the CPU in numpy, one thread: torch's isfinite over a vocabulary wakes its OpenMP threads, which
    then spin against the block kernel's (9 ms a call measured on 2 busy cores, numpy 0.04 ms). On a GPU where
    they are, before the step's synchronization."""
    if logits.device.type == "cpu":
        scores = logits.detach().float().numpy()
        if np.isfinite(scores).all():
            return
        broken = np.isnan(scores) | np.isposinf(scores)
        bad, empty = int(np.count_nonzero(broken)), not np.isfinite(scores).any(axis=-1).all()
    else:
        if bool(torch.isfinite(logits).all()):
            return
        broken = torch.isnan(logits) | torch.isposinf(logits)
        bad, empty = int(broken.sum()), not bool(torch.isfinite(logits).any(dim=-1).all())
    if bad == 0 and not empty:
        return
    raise NonFiniteLogits(f"the model produced NaN/infinite logits for this prompt: its weights or file are damaged "
                          f"({bad} of {logits.numel()} logits {where} are NaN or infinite"
                          f"{'' if bad else ', and none is finite'}); load it again, or download it again")


def token_logprob(logits: torch.Tensor, token: int, num_top: int, spell: Callable[[int], str]) -> TokenLogprob:
    """`token`'s log-probability under `logits` [V] (the log-softmax of the raw logits, in float64), with the
    `num_top` likeliest tokens there. `spell`: a token's text."""
    scores = logits.detach().to("cpu", torch.float32).numpy()
    top = float(scores.max())
    norm = top + float(np.log(np.exp(scores.astype(np.float64) - top).sum()))
    alternatives: tuple[TokenLogprob, ...] = ()
    if num_top > 0:
        k = min(num_top, scores.size)
        kth = np.partition(scores, scores.size - k)[scores.size - k]
        candidates = np.flatnonzero(scores >= kth)  # ties with the k-th included, in id order
        order = candidates[np.argsort(-scores[candidates], kind="stable")][:k]
        alternatives = tuple(TokenLogprob(int(i), spell(int(i)), float(scores[i]) - norm) for i in order)
    return TokenLogprob(token, spell(token), float(scores[token]) - norm, alternatives)


def _speller(tokenizer) -> Callable[[int], str]:
    """A token id's text as the tokenizer decodes it alone, special tokens included (remembered per request)."""
    known: dict[int, str] = {}

    def spell(token: int) -> str:
        text = known.get(token)
        if text is None:
            text = known[token] = tokenizer.decode([token], skip_special_tokens=False,
                                                   clean_up_tokenization_spaces=False)
        return text
    return spell


def decode_one_token(model, token_id: int, cache: DynamicCache, device) -> torch.Tensor:
    with spilling(cache):  # one block per forward: nothing stays active across the generator's yields
        out = model(input_ids=torch.tensor([[token_id]], device=device), past_key_values=cache, use_cache=True)
    return out.logits[0, -1]


@torch.inference_mode()
def run_forward(model, forward: Forward, device) -> torch.Tensor:
    """A request's decode-step Forward run by itself: logits [len(tokens), V] (prompt pieces:
    engine.prefill.prompt_forward). On a model in GGUF blocks, straight through the one-call forward's packed
    entry, as a batch of one (the same call and bits as through model(...), without the module call, the output
    object and the checks of its arguments: 0.15-0.24 ms of a 5 ms decode step on the embedded model in int4)."""
    if uses_block_forward(model):
        logits = model.forward.packed([forward.tokens], [forward.cache])  # None: not a cache it takes
        if logits is not None:
            return logits[0]
    if len(forward.tokens) == 1:
        return decode_one_token(model, forward.tokens[0], forward.cache, device)[None]
    return check_forward(model, forward.tokens, forward.cache, device, forward.rowwise)


def check_forward(model, tokens: list[int], cache: DynamicCache, device, rowwise: bool) -> torch.Tensor:
    """Feeds `tokens` (the last token, then the drafted ones) in one forward: next-token logits after each,
    [k+1, V]. `rowwise`: attention one position at a time, as decode steps compute it (paged.rowwise_attention)."""
    with rowwise_attention(model) if rowwise else contextlib.nullcontext():
        out = model(input_ids=torch.tensor([tokens], device=device), past_key_values=cache, use_cache=True)
    return out.logits[0]


def _history(ids: list[int], kept: Sequence[int], params: SamplingConfig) -> Sequence[int]:
    """The tokens before a checked position, for the repetition penalty: `ids` as they are where no penalty
    reads them (no copy of a long context for every checked position)."""
    return [*ids, *kept] if kept and params.repetition_penalty != 1.0 else ids


def _greedy_at(checked: torch.Tensor, params: SamplingConfig, ids: list[int]):
    """What greedy decoding would choose at checked position i, the `kept` drafts before it in the history."""
    return lambda i, kept: sample(checked[i], params, _history(ids, kept, params), None)


def _probs_at(checked: torch.Tensor, params: SamplingConfig, ids: list[int]):
    return lambda i, kept: sampling_probs(checked[i], params, _history(ids, kept, params))


def _text_of(tokenizer) -> Callable[[list[int]], str]:
    """The text of token ids as `tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)`
    says it. Where that call is transformers' own over a `tokenizers` backend, the backend's decode, which it
    returns as is: each streamed token decodes twice, and transformers' wrapper around the backend took 10 of the
    11 us a call took in a decode loop (the embedded model's tokenizer, int4 weights, a 2-vCPU Xeon)."""
    try:
        from tokenizers import Tokenizer
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers: its own decode
        TokenizersBackend = None
    backend = getattr(tokenizer, "_tokenizer", None)
    kind = type(tokenizer)
    if (TokenizersBackend is not None and isinstance(backend, Tokenizer) and isinstance(tokenizer, TokenizersBackend)
            and kind.decode is PreTrainedTokenizerBase.decode and kind._decode is TokenizersBackend._decode):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


class Detokenizer:
    """Incremental text for streamed ids: decodes a short window so multi-token characters come out whole,
    and holds back text that could be the start of a stop string."""

    def __init__(self, tokenizer, stop: Sequence[str]):
        self.tokenizer = tokenizer
        self._decode = _text_of(tokenizer)
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.text = ""  # all text decoded so far
        self.emitted = 0  # characters of self.text already handed out
        self._prefix_offset = 0
        self._read_offset = 0
        self.stopped = False

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


# In a batch, every drafted token is one more row through the linears for the whole step (over int4 kernels
# about 0.4 of a one-row step each, measured: 42 ms for 8 rows against 18 ms for 1), while alone extra rows cost
# little. So a batched request keeps drafting only while at least this share of its drafts was kept.
BATCHED_MIN_KEPT = 0.5


@dataclass(frozen=True)
class Decoder:
    """What every answer of one engine is decoded with: the model and its tokenizer, the device, the token ids that
    end an answer, the context limit, and how tokens are drafted (`speculative`: "prompt-lookup", "draft-model"
    with `draft_model`, or None; at most `num_draft` a forward)."""

    model: Any
    tokenizer: Any
    device: torch.device
    eos_ids: frozenset[int]
    max_context: int
    speculative: str | None = None
    num_draft: int = DEFAULT_NUM_DRAFT
    draft_model: Any = None
    spelling: Any = None  # speculative.Spellings of the tokenizer (prompt-lookup matches by it)


def _drafts_do_not_pay(stats: Stats) -> bool:
    return stats.drafted_tokens > 0 and stats.accepted_tokens < BATCHED_MIN_KEPT * stats.drafted_tokens


@torch.inference_mode()  # entered and left around each resume: coroutines interleave on one thread
def decode_tokens(decoder: Decoder, cache: DynamicCache, logits: torch.Tensor, ids: list[int],
                  params: SamplingConfig, stats: Stats, *, t_enter: float, cancel: threading.Event | None = None,
                  return_logits: bool = False) -> Generator:
    """Samples up to max_new_tokens from `logits`, the next-token logits [V] after the prompt `ids` whose KV
    fills `cache`, feeding each token back, until EOS, a stop string, the context limit or `cancel` (checked
    before every step). Every sampled token is appended to `ids`, so the caller can store the KV of
    ids[:cache length] however the loop ended. The decoder's "prompt-lookup": up to its `num_draft` tokens
    drafted from the context are checked in the forward that feeds each token (engine.speculative; not over a
    cache that spills, which cannot be cut back); "draft-model": drafted by its draft model (engine.draft_model).
    Completes `stats` (times from `t_enter`, the call's start) and
    yields it in the Result, after the TokenEvents. A coroutine: it also yields a batching.Forward for every
    forward pass it needs, and whoever runs it sends back the logits (batching.drive_alone, batching.Batch)."""
    model, device, eos_ids, max_context = decoder.model, decoder.device, decoder.eos_ids, decoder.max_context
    speculative, num_draft = decoder.speculative, decoder.num_draft
    prompt_len = len(ids)
    generator = None
    if params.temperature > 0:
        generator = torch.Generator()
        generator.manual_seed(params.seed if params.seed is not None else int.from_bytes(os.urandom(7), "little"))
    detok = Detokenizer(decoder.tokenizer, params.stop)
    drafts = None
    if speculative and not isinstance(cache, SpillingCache):
        drafts = (DraftModel(decoder.draft_model, ids, device) if speculative == "draft-model"
                  else NgramIndex(ids, decoder.spelling))
    rowwise = drafts is not None and hasattr(model, "config") and spill_unsupported(model) is None
    finish = None  # why the loop ended, once it has
    batched = False  # whether the last forward served other requests too (engine.batching)
    t_first = None
    # With logprobs asked for: every answer token's, and those not yet handed out with an event.
    answer_logprobs = [] if params.logprobs is not None else None
    pending: list[TokenLogprob] = []
    spell = _speller(decoder.tokenizer) if answer_logprobs is not None else None

    def handed_out() -> list[TokenLogprob] | None:
        if answer_logprobs is None:
            return None
        out = pending[:]
        pending.clear()
        return out

    def emit(token: int, row: torch.Tensor):
        """Hands `token` out (EOS is not), chosen from the logits `row` [V]; returns why generation ends after it,
        or None."""
        if token in eos_ids:
            return "stop"
        ids.append(token)
        if drafts is not None:
            drafts.append(token)
        if answer_logprobs is not None:
            answer_logprobs.append(token_logprob(row, token, params.logprobs, spell))
            pending.append(answer_logprobs[-1])
        delta = detok.add(token)
        if delta:
            yield TokenEvent(delta, token, handed_out())
        if detok.stopped:
            return "stop"
        if len(ids) - prompt_len >= params.max_new_tokens or len(ids) >= max_context:
            return "length"
        if cancel is not None and cancel.is_set():
            return "cancelled"
        return None

    check_finite(logits, "at the end of the prompt")
    first_logits = logits.float().cpu().clone() if return_logits else None
    chosen = None  # a token already chosen by a speculative check (its logits were in the checked forward)
    copying = False  # the last check kept every token it drafted from the context (speculative.draft_limit)
    while finish is None:
        token = chosen if chosen is not None else sample(logits, params, ids, generator)
        chosen = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if t_first is None:
            t_first = time.perf_counter()
            stats.ttft_ms = (t_first - t_enter) * 1000
        finish = yield from emit(token, logits)
        if finish is not None:
            break
        # Room for drafts: what max_new_tokens leaves, and the context (the cache then holds len(ids) + k).
        room = min(params.max_new_tokens - (len(ids) - prompt_len), max_context - 1 - len(ids))
        if batched and _drafts_do_not_pay(stats):
            room = 0
        limit = draft_limit(num_draft, copying and not batched)
        draft = drafts.draft(min(limit, room)) if drafts is not None and room > 0 else []
        stats.decode_forwards += 1
        step = Forward([token, *draft], cache, rowwise=rowwise and bool(draft))
        checked = yield step  # [k + 1, V]: whoever runs this coroutine runs the forward (alone or batched)
        check_finite(checked, f"after answer token {len(ids) - prompt_len}")
        batched = step.shared > 1
        stats.batched_forwards += batched
        copying = False
        if not draft:
            logits = checked[-1]
            continue
        kept, chosen = verify(draft, _greedy_at(checked, params, ids), _probs_at(checked, params, ids),
                              generator, is_greedy(params))
        copying = kept == len(draft) and speculative == "prompt-lookup"
        stats.drafted_tokens += len(draft)
        stats.accepted_tokens += kept
        if kept < len(draft):
            cache.crop(kept - len(draft))  # the rejected drafts' KV
        for i, accepted in enumerate(draft[:kept]):
            finish = yield from emit(accepted, checked[i])
            if finish is not None:
                break
        logits = checked[kept]  # what `chosen`, or the next token, is chosen from
    if drafts is not None and cache.get_seq_length() > len(ids):
        cache.crop(len(ids) - cache.get_seq_length())  # kept drafts past where the answer ended
    finish_reason = finish or "length"
    generated = ids[prompt_len:]
    tail = detok.finish()
    if tail or pending:
        yield TokenEvent(tail, generated[-1], handed_out())
    t_end = time.perf_counter()
    stats.spilled_tokens = spill_stats(cache)["spilled_tokens"]
    stats.generated_tokens = len(generated)
    stats.total_ms = (t_end - t_enter) * 1000
    if t_first is not None and len(generated) > 1:
        stats.decode_tokens_per_s = (len(generated) - 1) / max(t_end - t_first, 1e-9)
    yield Result(detok.text, generated, finish_reason, stats, first_logits, answer_logprobs)
