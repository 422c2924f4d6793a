"""Continuous batching: several requests' decode steps in one forward pass, each over its own cache.

A request runs as a coroutine (KVBoost._events): it yields its events (TokenEvent, Result) and a `Forward` whenever
it needs the model: a piece of its prompt, or the tokens of a decode step (the last sampled token, and any drafted
ones), over its own cache; the logits come back through `send`. Run alone (`drive_alone`), each Forward is
the plain forward a decode step has always been. A `Batch` (run by the EngineWorker) advances every running
request to its next Forward and answers all of them with ONE forward pass: their tokens packed into one sequence
of one batch row, so every weight is read once per step for the whole batch. A model whose layers are GGUF blocks
runs the packed step as one C call (engine.block_forward: the same split, the same kernels).

Exactness. Nothing is padded and no cache is shared: inside the packed forward, each layer's new keys and values
are split back into the requests' own caches (`PackedCache.update`) and attention is computed per request over
its own cache, through the same registered attention function and arguments a one-token decode step uses (drafted
tokens one position at a time, as paged.rowwise_attention does alone). Everything else in a decoder layer
(embedding, norms, rotary at each token's own position, linears, the head) works per token. So a request's
logits in a batch equal its logits alone wherever the linear kernels compute a row the same whatever the number
of rows: bit for bit over the int4 and int8 kernels; float32 sgemm rounds by row count (~1e-5 on the logits).

Newcomers join at the next step: their prefill runs in pieces of at most `DecodeConfig.prefill_piece_tokens`
(alone or batched the same, so the KV is the same), one piece per step. On a model in GGUF blocks the pieces ride
in the same C call as the others' decode tokens (a piece is a request's run of rows with causal attention among
them, computed row by row as alone: the same bits), so newcomers arriving together share one pass over the
weights; on other models a piece runs by itself within the step (float attention over a piece is not the same
computed row by row).
Only models whose attention can be split this way are batched (`batching_unavailable`); others run one request
at a time, as before.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

import torch
from transformers import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .block_forward import uses_block_forward
from .paged import spill_unsupported

log = logging.getLogger(__name__)

MAX_BATCH = 8  # requests decoded together; more wait in the worker's queue


@dataclass(eq=False)
class Forward:
    """A request's need for the model: feed `tokens` over `cache` and send back their logits [len(tokens), V].
    `rowwise`: several tokens attend one position at a time (drafted tokens; paged.rowwise_attention).
    `shared`: set by whoever runs it, the number of requests the forward served."""

    tokens: list[int]
    cache: Any
    rowwise: bool = False
    prompt: bool = False  # a prefill piece: its tokens attend to each other causally, as a prompt's do
    keep: int | None = None  # logits for the last `keep` tokens only (0: none, the layers alone); None: every token
    shared: int = 1
    seconds: float = 0.0  # set by whoever runs it: its share of the forward's time


def packs_prompts(model) -> bool:
    """Whether prompt pieces ride in the packed forward with the decode steps (a model in GGUF blocks)."""
    return uses_block_forward(model)


def batching_unavailable(model) -> str | None:
    """Why requests on `model` cannot share a forward, or None when they can: attention must be split per
    request exactly (full causal attention through transformers' registry, as paged attention needs)."""
    why = spill_unsupported(model)
    if why is not None:
        return why
    if ALL_ATTENTION_FUNCTIONS.get(model.config._attn_implementation) is None:
        return f"attention implementation {model.config._attn_implementation!r} has no registry entry to split"
    return None


# ------------------------------------------------------------------------------------------ the packed forward

class PackedCache(DynamicCache):
    """What the model sees as its cache in a packed forward: each layer's update is split into the requests'
    own caches (rows of `sizes` tokens, in order), and what each returned is kept for the attention hook."""

    def __init__(self, caches: list, sizes: list[int]):
        super().__init__()
        self.caches, self.sizes = caches, sizes
        self.returned: dict[int, tuple[torch.Tensor, list]] = {}  # layer -> (the keys handed back, per request)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        rows, start = [], 0
        for cache, size in zip(self.caches, self.sizes):
            k, v = cache.update(key_states[:, :, start:start + size], value_states[:, :, start:start + size],
                                layer_idx)
            rows.append((start, size, k, v))
            start += size
        self.returned[layer_idx] = (key_states, rows)
        return key_states, value_states


_local = threading.local()  # .packed: the PackedCache of the forward running on this thread, if any
_hook_lock = threading.Lock()
_splitters: dict[str, Any] = {}  # attention implementation -> the splitter registered for it


def _register_splitter(impl: str) -> None:
    """Registers for `impl`, once, a function that runs the registered one per request where this thread's packed
    forward handed back the keys, and unchanged everywhere else (other threads, other caches, no packed forward).
    Registered again only where something has replaced it since (it wraps whatever is registered then)."""
    with _hook_lock:
        current = ALL_ATTENTION_FUNCTIONS.get(impl)
        if current is None or current is _splitters.get(impl):
            return
        if getattr(current, "splits_packed", False):  # one of ours, put back by a hook that had wrapped it
            _splitters[impl] = current
            return
        _splitters[impl] = ALL_ATTENTION_FUNCTIONS[impl] = _splitter(current)


@contextmanager
def _split_attention(impl: str, packed: PackedCache):
    """Within the block, attention calls on this thread whose keys are what `packed` handed back run per
    request (the registry is written once per implementation, not per forward)."""
    _register_splitter(impl)
    _local.packed = packed
    try:
        yield
    finally:
        _local.packed = None


def _splitter(registered):
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        packed = getattr(_local, "packed", None)
        entry = packed.returned.get(getattr(module, "layer_idx", None)) if packed is not None else None
        if entry is None or entry[0] is not key:
            return registered(module, query, key, value, attention_mask, *args, **kwargs)
        outputs = []
        for start, size, k, v in entry[1]:
            length = k.shape[2]
            for i in range(size):  # one position at a time, over the keys up to it: what a decode step computes
                end = length - size + 1 + i
                out, _ = registered(module, query[:, :, start + i:start + i + 1], k[:, :, :end], v[:, :, :end],
                                    None, *args, **kwargs)
                outputs.append(out)  # [1, 1, H, D]
        return torch.cat(outputs, dim=1), None

    attention.splits_packed = True
    return attention


@torch.inference_mode()
def packed_forward(model, forwards: list[Forward], device) -> list[torch.Tensor | None] | None:
    """One forward for every Forward: their tokens packed in one sequence, each at its own positions; returns
    each one's logits [len(tokens) or keep, V] (None for keep 0). None (nothing computed) when prompt pieces are
    among them and the one-call forward cannot take this batch: they run alone then (`packs_prompts`)."""
    sizes = [len(f.tokens) for f in forwards]
    if uses_block_forward(model):  # GGUF blocks: every layer of every request in one C call (engine.block_forward)
        logits = model.forward.packed([f.tokens for f in forwards], [f.cache for f in forwards],
                                      [f.keep for f in forwards])
        if logits is not None:
            return logits
    if any(f.prompt for f in forwards):  # float attention over a piece is not the same computed row by row
        return None
    tokens = [t for f in forwards for t in f.tokens]
    starts = [f.cache.get_seq_length() for f in forwards]
    positions = [p for f, start in zip(forwards, starts) for p in range(start, start + len(f.tokens))]
    packed = PackedCache([f.cache for f in forwards], sizes)
    with _split_attention(model.config._attn_implementation, packed):
        out = model(input_ids=torch.tensor([tokens], device=device),
                    position_ids=torch.tensor([positions], device=device), past_key_values=packed, use_cache=True)
    logits = out.logits[0]
    return list(torch.split(logits, sizes))


# -------------------------------------------------------------------------------------------- running requests

def drive_alone(steps, forward: Callable[[Forward], torch.Tensor]):
    """The events of one request coroutine run by itself: each Forward answered by `forward`, pauses skipped.
    Closing this generator closes the request (its `finally` stores and releases)."""
    value = None
    try:
        while True:
            try:
                item = steps.send(value)
            except StopIteration:
                return
            value = None
            if isinstance(item, Forward):
                value = forward(item)
            else:
                yield item
    finally:
        steps.close()


class RequestStream:
    """What KVBoost.stream returns: an iterator of the request's events (TokenEvents, then the Result), run alone
    on the calling thread the first time it is iterated, with the engine's lock held until it ends or is closed;
    or handed whole to an EngineWorker's batch (`take_steps`), which decodes it together with other requests.

    The engine is released as soon as the Result is handed out, when the stream is closed (`close()`, or leaving
    a `with` block), and when the consumer drops it, e.g. by breaking out of its `for` loop: nothing it holds
    refers back to it, so it goes with its last reference, not at some later garbage collection."""

    def __init__(self, engine, steps):
        self.engine = engine
        self._steps = steps
        self._alone = None

    def batch_refusal(self) -> str | None:
        """Why this request cannot join a batch, or None."""
        if self._alone is not None or self._steps is None:
            return "it has already started"
        return self.engine.batching_unavailable()

    def take_steps(self):
        """The request's coroutine, for a batch to run (the stream itself then yields nothing)."""
        steps, self._steps = self._steps, None
        return steps

    def __iter__(self):
        return self

    def __next__(self):
        if self._alone is None:
            if self._steps is None:
                raise StopIteration
            self._alone = _run_alone(self.engine, self._steps)
            self._steps = None
        event = next(self._alone)
        if getattr(event, "ends_request", False):  # the Result: the engine is free before the consumer asks again
            self.close()
        return event

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Ends the request where it is (it stores what it computed and releases what it holds and the engine)."""
        if self._alone is not None:
            self._alone.close()
        elif self._steps is not None:
            self._steps.close()
            self._steps = None


def _run_alone(engine, steps):
    """The request's events under the engine's lock. A function, not a method of RequestStream: a generator
    holding the stream would keep it alive through a reference cycle after its consumer let go."""
    with engine.runner.one_request():
        yield from drive_alone(steps, engine.runner.forward)


@dataclass(eq=False)
class Member:
    """A request in a batch: its coroutine, the engine it runs on, where its events go, what it waits for."""

    steps: Any
    engine: Any
    deliver: Callable[[Any], None]
    on_end: Callable[[BaseException | None], None]
    pending: Any = None  # what the next send() hands the coroutine (its logits)
    waiting: Forward | None = None
    done: bool = False


class Batch:
    """The requests decoding together on one model. `step()` advances each to its next Forward (delivering its
    events; a newcomer runs its plan and a prefill piece) and answers them all with one forward pass."""

    def __init__(self, max_size: int = MAX_BATCH):
        self.max_size = max_size
        self.members: list[Member] = []

    def __len__(self) -> int:
        return len(self.members)

    def accepts(self, engine) -> bool:
        """Whether a request on `engine` can join now (room, and the same model as the batch)."""
        return len(self.members) < self.max_size and (not self.members or engine.model is self.members[0].engine.model)

    def admit(self, steps, engine, deliver, on_end) -> Member:
        member = Member(steps, engine, deliver, on_end)
        self.members.append(member)
        return member

    def step(self) -> None:
        """One step of every member, with the lock of every engine in the batch held for its duration (between
        steps, other work on those engines can run: a warm-up, a request on another thread)."""
        engines = sorted({id(m.engine): m.engine for m in self.members}.items())
        for _, engine in engines:
            engine.runner.lock.acquire()
        try:
            self._step()
        finally:
            for _, engine in reversed(engines):
                engine.runner.lock.release()

    def _step(self) -> None:
        for member in list(self.members):
            self._advance(member)
        ready = [m for m in self.members if m.waiting is not None]
        if not ready:
            return
        engine = ready[0].engine
        together = ready
        if not packs_prompts(engine.model):  # prompt pieces by themselves, then the decode steps together
            together = [m for m in ready if not m.waiting.prompt]
            for m in ready:
                if m.waiting.prompt:
                    self._answer([m], engine)
        if together:
            self._answer(together, engine)

    def _answer(self, members: list[Member], engine) -> None:
        """One forward for `members`' Forwards; a failed forward fails the requests in it (the batch goes on)."""
        forwards = [m.waiting for m in members]
        began = time.perf_counter()
        try:
            if len(members) == 1:
                results = [engine.runner.forward(forwards[0])]
            else:
                results = packed_forward(engine.model, forwards, engine.device)
        except BaseException as exc:
            for m in members:
                self._end(m, exc)
            return
        if results is None:  # prompt pieces this pass could not take: each alone, then the others together
            for m in members:
                if m.waiting.prompt:
                    self._answer([m], engine)
            rest = [m for m in members if m.waiting is not None and not m.done]
            if rest:
                self._answer(rest, engine)
            return
        if len(members) > 1:  # each Forward's share of the pass's time, by its tokens
            elapsed, rows = time.perf_counter() - began, sum(len(f.tokens) for f in forwards)
            for f in forwards:
                f.seconds = elapsed * len(f.tokens) / rows
        for m, logits in zip(members, results):
            m.waiting.shared = len(members)
            m.pending, m.waiting = logits, None

    def _advance(self, member: Member) -> None:
        """Runs `member` to its next Forward or pause, handing out its events; ends it when it returns/raises."""
        value, member.pending = member.pending, None
        while True:
            try:
                item = member.steps.send(value)
            except StopIteration:
                self._end(member, None)
                return
            except BaseException as exc:
                self._end(member, exc)
                return
            value = None
            if isinstance(item, Forward):
                member.waiting = item
                return
            try:
                member.deliver(item)
            except BaseException as exc:  # the front end's failure ends its request only
                self._end(member, exc)
                return

    def _end(self, member: Member, error: BaseException | None) -> None:
        if member.done:
            return
        member.done = True
        self.members.remove(member)
        try:
            member.steps.close()  # runs the request's finally: its KV stored, its entries released
        except Exception:
            log.exception("closing a batched request failed")
        member.on_end(error)
