"""Who answers the app's requests: this process's engine, or a remote OpenAI-compatible server.

Both backends take the same calls, `chat(request, messages, sampling)`, `warm(request, texts)` and `close()`,
and report through the request handles (app.answers), so EngineClient and the tabs never ask which one answers.

LocalBackend: every torch call runs on ONE thread, the engine.EngineWorker this backend starts (and lends to
the API server when the app serves its model: one torch thread, one queue). `engine` (torch, transformers) is
imported on a short-lived thread that then starts the worker, so the window comes up before that
multi-second import finishes; work submitted meanwhile waits for it, in order. The window's jobs run in the order
submitted and take turns with the API's (the worker's round robin between sources); cancelling a job that is still
queued drops it (it ends as cancelled without running); cancelling the running one stops it at the next token, or a
model load at its next stage.

RemoteBackend: answers stream from the server (app.remote_provider) on one thread of its own, in order.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from .answers import Answer, ChatRequest, WarmReport, WarmRequest
from .background import executor, start_thread

log = logging.getLogger(__name__)

# Requests whose prefill computed at least this many tokens calibrate the "time saved" estimate.
MIN_CALIBRATION_TOKENS = 32  # fewer computed tokens say little about a token's cost (a forward's fixed costs)
CALIBRATION_WINDOW = 64  # prefills the median runs over
SOURCE = "window"  # the worker's label for the app's jobs; the API server's are "api"
_IMPORT_LOCK = threading.Lock()


def import_engine() -> None:
    """Imports the engine's heavy half (torch, transformers) on the calling thread, one thread at a time. The
    engine package imports its modules on first use, and two threads importing transformers at once can deadlock
    on its module locks, which Python breaks by handing one of them a half-made module ("cannot import name
    'AutoConfig'"); the worker's starter and the weight-size thread both get here first."""
    with _IMPORT_LOCK:
        import engine.engine  # noqa: F401
        import engine.worker  # noqa: F401


def describe(exc: BaseException) -> str:
    """A message for the UI: the project's errors (all ValueErrors) already say what and why; others get
    their type."""
    if isinstance(exc, ValueError):
        return str(exc)
    if isinstance(exc, MemoryError) or "out of memory" in str(exc).lower():
        return f"Out of memory: {exc}. Try a smaller model, a shorter prompt or fewer documents."
    return f"{type(exc).__name__}: {exc}"


class Backend(Protocol):
    """What answers a tab's requests."""

    def chat(self, request: ChatRequest, messages: list[dict], sampling: dict) -> None:
        """Answers `messages`; reports on `request` (started, tokens, then finished or failed)."""

    def warm(self, request: WarmRequest, texts: list) -> None:
        """Pre-fills `texts` where later prompts can reuse them; reports on `request`."""

    def close(self) -> None:
        """Stops taking requests; those still queued end without running."""


class LoadEvents(Protocol):
    """Where LocalBackend reports a model load (EngineClient's signals)."""

    def starting(self) -> None: ...
    def loading(self, what: str, stage: str) -> None: ...
    def stage(self, text: str) -> None: ...
    def progressed(self, done: int, total: int, what: str) -> None: ...
    def loaded(self, engine, source: str | None, load_s: float) -> None: ...
    def failed(self, message: str) -> None: ...
    def cancelled(self) -> None: ...


class LocalBackend:
    """This process's engine on its one worker thread (see the module docstring)."""

    def __init__(self, events: LoadEvents):
        self._events = events
        self.engine = None  # set and cleared on the worker only; read anywhere (memory(), is_loaded)
        self._prefill_rates: list[tuple[float, int]] = []  # ms per computed prompt token, recent prefills
        self._lock = threading.Lock()  # guards the four below, which the starter thread sets
        self.worker = None  # engine.EngineWorker, once `engine` is imported
        self._import_error: Exception | None = None  # why `engine` could not be imported
        self._early: list[tuple[Callable, Callable]] = []  # (send, fail) of submissions made before the worker
        self._closed = False  # close() was called: nothing more runs, nothing more is reported
        self._starter = start_thread(self._start_worker, "kvboost-engine-import")

    # -- loads -------------------------------------------------------------------------------------------
    def load(self, source: str | None, options: dict, what: str, cancel: threading.Event) -> None:
        """Loads `source` (None: the embedded default) with from_pretrained `options`; reports to the events."""
        # While torch is still being imported the load says so at once, not when it starts.
        announce_now = self.worker is None and self._import_error is None

        def run():
            self.engine = None  # the old model goes before the new one is read, so two never share memory
            self._events.starting()
            if not announce_now:
                self._events.loading(what, "Starting PyTorch and transformers…")
            log.info("loading the model: %s", what)
            from engine import KVBoost

            t0 = time.perf_counter()
            self._events.stage("Reading and preparing the weights…")
            engine = KVBoost.from_pretrained(source, quiet=True, cancel=cancel, progress=self._events.progressed,
                                             **options)
            self._adopt(engine, source, t0)

        if announce_now:
            self._events.loading(what, "Starting PyTorch and transformers…")
        self._submit(run, cancel, self._load_failed, self._events.cancelled)

    def adopt(self, engine) -> None:
        """Serves an already loaded engine (tests share one model this way)."""
        self._submit(lambda: self._adopt(engine, None, time.perf_counter()), threading.Event(), self._load_failed,
                     self._events.cancelled)

    def _adopt(self, engine, source: str | None, t0: float) -> None:
        self.engine = engine
        self._prefill_rates = []  # another model: another rate
        self._events.loaded(engine, source, time.perf_counter() - t0)

    def _load_failed(self, exc: BaseException) -> None:
        from engine import Cancelled

        if isinstance(exc, Cancelled):  # stopped between stages: no failure
            log.info("model load cancelled")
            self._events.cancelled()
        else:
            self._events.failed(describe(exc))

    def _require_engine(self):
        if self.engine is None:
            raise RuntimeError("no model is loaded")
        return self.engine

    # -- answers -----------------------------------------------------------------------------------------
    def chat(self, request: ChatRequest, messages: list[dict], sampling: dict) -> None:
        # The job returns its request stream, which the worker decodes in one batch with the other tabs' and the
        # API's requests; its events come to `event`.
        running = {}

        def run():
            engine = self._require_engine()
            running["engine"], running["ids"] = engine, engine.encode(messages)
            request.post_started()
            return engine.stream(running["ids"], cancel=request.cancel_event, progress=True, **sampling)

        def event(item) -> None:
            from engine import PromptProgress, Result

            if isinstance(item, PromptProgress):
                request.post_prompt_read(item.done, item.total)
            elif not isinstance(item, Result):
                if item.text:
                    request.post_token(item.text)
            else:
                request.post_finished(self._answer(running["engine"], running["ids"], item))

        self._submit(run, request.cancel_event, lambda exc: request.post_failed(describe(exc)),
                     lambda: request.post_finished(Answer.cancelled()), sink=event)

    def _answer(self, engine, ids: list[int], result) -> Answer:
        stats = result.stats
        segments = [{"start": s, "end": e, "kind": kind, "text": engine.decode(ids[s:e])}
                    for s, e, kind in stats.chunks]
        if stats.repair == "none":  # a blend pass computes tokens outside the timed forwards
            self._calibrate(stats.prefill_ms, stats.recomputed_tokens)
        rate = self.prefill_ms_per_token()
        # Estimate: a full prefill would also have computed the reused tokens at the measured rate (None until a
        # mostly computed request or a pre-warm has measured it).
        return Answer(text=result.text, finish_reason=result.finish_reason, stats=stats.to_dict(),
                      segments=segments, saved_ms=stats.reused_tokens * rate if rate else None)

    def warm(self, request: WarmRequest, texts: list) -> None:
        def run():
            engine = self._require_engine()
            totals = WarmReport()
            for i, text in enumerate(texts):
                if request.cancelled:
                    totals = dataclasses.replace(totals, cancelled=True)
                    break
                report = engine.warm(text)
                self._calibrate(report["prefill_ms"], report["computed_tokens"])
                totals = totals.plus(report)
                request.post_progress(i + 1, len(texts))
            request.post_finished(totals)

        self._submit(run, request.cancel_event, lambda exc: request.post_failed(describe(exc)),
                     lambda: request.post_finished(WarmReport(cancelled=True)))

    def _calibrate(self, prefill_ms: float, computed: int) -> None:
        """Records what a token of prefill cost: the engine's own timing of the computed forward passes (not the
        request's TTFT, whose fixed costs would make a short prompt's tokens look dear)."""
        if computed >= MIN_CALIBRATION_TOKENS and prefill_ms > 0:
            self._prefill_rates.append((prefill_ms / computed, computed))
            del self._prefill_rates[:-CALIBRATION_WINDOW]

    def prefill_ms_per_token(self) -> float | None:
        """What a prefill token costs, over this session's recent prefills: the median over their tokens (half of
        the tokens computed cost at most this), so a few short prompts, whose forwards cost more a token, do not
        move it. None before a prefill was timed. "Time saved" multiplies the reused tokens by it."""
        if not self._prefill_rates:
            return None
        half, seen = sum(n for _, n in self._prefill_rates) / 2, 0
        for rate, n in sorted(self._prefill_rates):
            seen += n
            if seen >= half:
                return rate
        return None

    # -- the worker ----------------------------------------------------------------------------------------
    def _submit(self, run: Callable, cancel: threading.Event, fail: Callable[[BaseException], None],
                skipped: Callable[[], None], sink: Callable | None = None) -> None:
        """`run()` on the worker, after everything submitted before it. `fail(exc)` when it raises (or `engine`
        cannot be imported), `skipped()` when it was cancelled before it ran; neither once the backend is
        closed."""
        def on_done(job) -> None:
            if self._closed:
                return
            if job.state == job.SKIPPED:
                skipped()
            elif job.state == job.FAILED:
                log.error("engine job %s failed", job.id, exc_info=job.error)
                fail(job.error)

        def send(worker) -> None:
            worker.submit(lambda _cancel: run(), source=SOURCE, cancel=cancel, sink=sink, on_done=on_done)

        with self._lock:
            if self._closed:
                return
            if self.worker is not None:
                send(self.worker)
                return
            if self._import_error is None:
                self._early.append((send, fail))
                return
            error = self._import_error
        fail(error)

    def _start_worker(self) -> None:
        try:
            import_engine()  # torch and transformers: seconds, kept off the UI thread
            from engine import EngineWorker
        except Exception as exc:  # a broken install: everything fails with the reason, the window stays
            log.exception("the engine could not be imported")
            with self._lock:
                self._import_error = exc
                early, self._early = self._early, []
            for _send, fail in early:
                fail(exc)
            return
        with self._lock:
            if self._closed:
                return
            self.worker = EngineWorker(name="kvboost-engine")
            for send, _fail in self._early:
                send(self.worker)
            self._early = []

    def close(self, timeout: float = 0.0) -> bool:
        """Stops the worker, waiting up to `timeout` seconds (jobs must have been cancelled). Whether it ended:
        False when a job outlived the deadline (a model load inside one long stage, or torch still importing)."""
        with self._lock:
            self._closed = True
            worker, self._early = self.worker, []
        if worker is None:  # still importing torch: nothing to wait for, and it starts nothing now
            return not self._starter.is_alive()
        return worker.stop(timeout)

    def alive(self) -> bool:
        worker = self.worker
        return self._starter.is_alive() or (worker is not None and worker.is_alive())


class RemoteBackend:
    """Answers from `model` on an OpenAI-compatible server (app.remote_provider.RemoteProvider), streamed on one
    thread of its own, in order. A remote server's cache is its own: a pre-warm has nothing to do here."""

    def __init__(self, provider, model: str):
        self.provider = provider
        self.model = model
        self._thread = executor("kvboost-remote")

    def chat(self, request: ChatRequest, messages: list[dict], sampling: dict) -> None:
        self._thread.submit(self._run, request, messages, sampling)

    def _run(self, request: ChatRequest, messages: list[dict], sampling: dict) -> None:
        if request.cancelled:  # stopped while waiting its turn
            request.post_finished(Answer.cancelled())
            return
        request.post_started()
        try:
            answer = self.provider.chat(messages, sampling, model=self.model, cancel=request.cancel_event,
                                        on_text=request.post_token)
        except Exception as exc:
            log.error("remote answer %s failed", request.id, exc_info=exc)
            request.post_failed(describe(exc))
            return
        request.post_finished(Answer(**answer))

    def warm(self, request: WarmRequest, texts: list) -> None:
        request.post_finished(WarmReport())

    def close(self) -> None:
        """Takes no more requests; those already queued still run (cancelled ones end at once), so every handle
        given out gets its end."""
        self._thread.shutdown(wait=False)
