"""The app's only door to the engine.

Every torch call runs on ONE thread: the engine.EngineWorker this client owns, and lends to the API server
when the app serves its model (one torch thread, one queue). The UI thread only submits jobs and receives Qt
signals. Signals are emitted from the worker and, because EngineClient lives on the UI thread, Qt queues them
to it: slots always run on the UI thread. `engine` (torch, transformers) is imported on a short-lived thread
that then starts the worker, so the window comes up before that multi-second import finishes; jobs submitted
meanwhile wait for it, in order.

The window's jobs run in the order submitted and take turns with the API's (the worker's round robin between
sources). Cancelling a job that is still queued drops it (it ends as cancelled without running); cancelling
the running one stops it at the next token (the engine checks a threading.Event every decode step), or a
model load at its next stage.

Over 400 lines: the one door between the app and the engine (load, chat, warm, sizes, serving) in one class; local
and remote answering still share it, in branches."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field

from PySide6.QtCore import QObject, QTimer, Signal

from .background import Background, executor, start_thread

log = logging.getLogger(__name__)

# Requests whose prefill computed at least this many tokens calibrate the "time saved" estimate.
MIN_CALIBRATION_TOKENS = 32  # fewer computed tokens say little about a token's cost (a forward's fixed costs)
CALIBRATION_WINDOW = 64  # prefills the median runs over
SOURCE = "window"  # the worker's label for this client's jobs; the API server's are "api"
_IMPORT_LOCK = threading.Lock()


def import_engine() -> None:
    """Imports the engine's heavy half (torch, transformers) on the calling thread, one thread at a time. The
    engine package imports its modules on first use, and two threads importing transformers at once can deadlock
    on its module locks, which Python breaks by handing one of them a half-made module ("cannot import name
    'AutoConfig'"); the worker's starter and the weight-size thread both get here first."""
    with _IMPORT_LOCK:
        import engine.engine  # noqa: F401
        import engine.worker  # noqa: F401


@dataclass
class _Job:
    id: int
    kind: str  # "load" | "chat" | "warm"
    payload: dict
    cancel: threading.Event = field(default_factory=threading.Event)


class EngineClient(QObject):
    model_loading = Signal(str)  # what is being loaded
    load_stage_changed = Signal(str)
    load_progressed = Signal(int, int, str)  # steps done, steps in all (0: unknown), what was just done
    model_loaded = Signal(dict)  # model_info
    model_load_failed = Signal(str)
    model_load_cancelled = Signal()  # the load was stopped (quitting): nothing to report, no model loaded
    generation_started = Signal(int)
    token_generated = Signal(int, str)  # job id, visible text delta
    generation_finished = Signal(int, dict)  # job id, answer (see _run_chat)
    generation_failed = Signal(int, str)
    warm_progressed = Signal(int, int, int)  # job id, texts done, texts total
    warm_finished = Signal(int, dict)
    warm_failed = Signal(int, str)
    server_started = Signal(str)  # base URL of the OpenAI-compatible API
    server_stopped = Signal()
    server_failed = Signal(str)
    weights_estimated = Signal(str, dict)  # source ("" for the built-in model), engine.weights.weight_sizes.estimate

    def __init__(self, parent=None, engine_options: dict | None = None):
        """`engine_options`: from_pretrained options applied to every load (the app's KV cache folder)."""
        super().__init__(parent)
        self._engine_options = dict(engine_options or {})
        self._pending: dict[int, _Job] = {}  # submitted and not finished, by id
        self._ids = itertools.count(1)
        self._engine = None  # touched on the worker only, except the read-only memory()/is_loaded
        self._info: dict | None = None
        self._prefill_rates: list[float] = []  # ms per computed prompt token, recent prefills: "time saved"
        self._server = None  # (server.thread.ServerThread, url) of the in-process API server
        self._lock = threading.Lock()  # guards the four below, which the starter thread sets
        self._worker = None  # engine.EngineWorker, once `engine` is imported
        self._import_error: Exception | None = None  # why `engine` could not be imported
        self._early: list[_Job] = []  # submitted before the worker existed, in order
        self._closed = False  # shutdown() was called: no more jobs, no more signals about them
        self._remote = None  # (app.remote_provider.RemoteProvider, model id) while answers come from a server
        self._remote_jobs = None  # the one thread remote answers stream on, in order (made on first use)
        self._background = Background(self)
        self._starter = start_thread(self._start_worker, "kvboost-engine-import")

    # -- UI-thread API -------------------------------------------------------------------------------------
    @property
    def is_loaded(self) -> bool:
        return self._engine is not None or self._remote is not None

    @property
    def model_info(self) -> dict | None:
        return self._info

    def load_model(self, source: str | None = None, **options) -> int:
        """Loads `source` (None: the embedded default) with engine options (reuse, layer_streaming, ...)."""
        self._remote = None  # answers come from the engine again (chats sent from now on queue behind the load)
        return self._submit("load", {"source": source, "options": {**self._engine_options, **options},
                                     "what": source or "SmolLM2-135M-Instruct (built in)"})

    def estimate_weights(self, source: str | None) -> None:
        """The memory `source`'s weights would take per format (weights_estimated(source, sizes) follows;
        sizes {"error": reason} when its config cannot be read). Reads the config on a thread of its own: no
        torch work, so it neither waits behind a generation nor delays one."""
        def run():
            import_engine()
            from engine.weights import stream_setup, weight_sizes

            sizes = weight_sizes.estimate(source)
            sizes["streaming"] = stream_setup.streaming_estimate(source, sizes)
            return sizes

        # a path being typed, a damaged file: the dialog says why
        self._background.run(run, lambda sizes: self.weights_estimated.emit(source or "", sizes),
                             lambda exc: self.weights_estimated.emit(source or "", {"error": _describe(exc)}),
                             name="kvboost-weight-sizes")

    def model_library(self, **options):
        """The model library over the standard HF cache (hub.models.ModelHub; `options`: endpoint, cache_dir,
        token). Importing the engine takes seconds and the library's calls do network and disk I/O: call this and
        them off the UI thread and off the engine thread (app.models_dialog runs them on threads of its own)."""
        from hub.models import ModelHub

        return ModelHub(**options)

    # -- answers from a remote OpenAI-compatible server (app.remote_provider) --------------------------------
    @property
    def is_remote(self) -> bool:
        return self._remote is not None

    def use_remote(self, base_url: str, model: str, api_key: str | None = None, *, max_context: int = 8192) -> None:
        """Answers come from `model` on the OpenAI-compatible server at `base_url` from now on (load_model goes
        back to the engine); model_loaded follows with info that says so. A model the engine holds stays loaded
        until the next load_model."""
        from .remote_provider import RemoteProvider

        self._remote = (RemoteProvider(base_url, api_key), model)
        self._info = {"name": model, "remote": True, "base_url": base_url, "device": f"remote {base_url}",
                      "dtype": "remote", "max_context": max_context, "reuse": "remote", "load_s": 0.0,
                      "source": None}
        self.model_loaded.emit(dict(self._info))

    def _submit_remote(self, messages: list[dict], sampling: dict) -> int:
        job = _Job(next(self._ids), "chat", {"messages": messages, "sampling": sampling})
        if self._closed:
            return job.id
        if self._remote_jobs is None:
            self._remote_jobs = executor("kvboost-remote")
        self._pending[job.id] = job
        provider, model = self._remote
        self._remote_jobs.submit(self._run_remote, job, provider, model)
        return job.id

    def _run_remote(self, job: _Job, provider, model: str) -> None:
        """On the remote thread: one streamed answer, reported with the engine's signals."""
        try:
            if job.cancel.is_set():  # stopped while waiting its turn
                answer = {"text": "", "finish_reason": "cancelled", "stats": None, "segments": [], "saved_ms": 0.0}
            else:
                self.generation_started.emit(job.id)
                answer = provider.chat(job.payload["messages"], job.payload["sampling"], model=model,
                                       cancel=job.cancel, on_text=lambda text: self.token_generated.emit(job.id, text))
        except Exception as exc:
            self._pending.pop(job.id, None)
            if not self._closed:
                self._report_failure(job, exc)
            return
        self._pending.pop(job.id, None)
        if not self._closed:
            self.generation_finished.emit(job.id, answer)

    def use_engine(self, engine) -> int:
        """Adopts an already loaded engine (tests share one model this way; the engine must not be used
        elsewhere while this client runs it)."""
        return self._submit("load", {"engine": engine})

    def chat(self, messages: list[dict], sampling: dict | None = None) -> int:
        if self._remote is not None:
            return self._submit_remote(messages, dict(sampling or {}))
        return self._submit("chat", {"messages": messages, "sampling": dict(sampling or {})})

    def warm(self, texts: list) -> int:
        """Pre-fills each text (a string or a message list) so later prompts containing it reuse its KV."""
        if self._remote is not None:  # a remote server's cache is its own: nothing to warm here
            job_id = next(self._ids)
            QTimer.singleShot(0, lambda: self.warm_finished.emit(job_id, _warm_totals(cancelled=False)))
            return job_id
        return self._submit("warm", {"texts": list(texts)})

    def cancel(self, job_id: int) -> None:
        job = self._pending.get(job_id)
        if job is not None:
            job.cancel.set()

    def cancel_all(self) -> None:
        for job in list(self._pending.values()):
            job.cancel.set()

    def memory(self) -> dict | None:
        """Engine memory report (weights, KV per tier, device totals); None before a model is loaded."""
        engine = self._engine
        return engine.memory().to_dict() if engine is not None else None

    # -- the OpenAI-compatible API over the loaded model (server.thread), in this process ------------------
    @property
    def server_url(self) -> str | None:
        return self._server[1] if self._server is not None else None

    def start_server(self, port: int = 8000, api_key: str | None = None) -> None:
        """Serves the loaded engine on 127.0.0.1:`port` (HTTP on a thread of its own); server_started(url) or
        server_failed(reason) follows. The API's requests run on this client's worker, taking turns with the
        window's, so the model is loaded once and one thread runs torch."""
        engine = self._engine
        if engine is None or self._worker is None:
            self.server_failed.emit("load a model first")
            return
        self.stop_server()
        try:
            from server.thread import ServerThread
        except ImportError as exc:
            self.server_failed.emit(f"the server needs its extra (pip install 'kvboost-desktop[server]'): {exc}")
            return
        from pathlib import Path

        model_id = Path(engine.info().name).name.removesuffix(".gguf")
        # kvboost-server's settings (the same client deadlines), on this process's loaded engine
        running = ServerThread(engine, model_id=model_id, worker=self._worker, port=port, api_key=api_key).start()
        url = f"{running.url}/v1"
        self._server = (running, url)

        def wait_until_up(deadline=time.monotonic() + 10):
            if self._server is None or self._server[0] is not running:
                return
            if running.started:
                self.server_started.emit(url)
            elif not running.alive or time.monotonic() > deadline:
                self._server = None
                running.stop(timeout_s=None)
                self.server_failed.emit(f"could not listen on 127.0.0.1:{port} (is the port in use?)")
            else:
                QTimer.singleShot(50, wait_until_up)

        QTimer.singleShot(50, wait_until_up)

    def stop_server(self) -> None:
        """Cancels the API's running and waiting requests (the window's go on) and stops it; server_stopped
        follows once its thread has exited (never blocks the UI thread)."""
        if self._server is None:
            return
        running, _url = self._server
        self._server = None
        running.stop(timeout_s=None)

        def join_then_report():
            running.join(timeout_s=30)
            self.server_stopped.emit()  # queued to the UI thread

        start_thread(join_then_report, "kvboost-api-stop")

    def shutdown(self, timeout: float = 5.0) -> bool:
        """Stops the API server, cancels every job (no signals about them follow) and stops the engine thread,
        waiting up to `timeout` seconds. Returns whether it ended: False when a job outlived the deadline (a
        model load inside one long stage, or torch still being imported)."""
        self.stop_server()
        if self._remote_jobs is not None:
            self._remote_jobs.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            self._closed = True
            worker, self._early = self._worker, []
        self.cancel_all()
        if worker is None:  # still importing torch: nothing to wait for, and it starts nothing now
            return not self._starter.is_alive()
        return worker.stop(timeout)

    def worker_alive(self) -> bool:
        """Whether the engine's threads are still running (after shutdown(): a job that outlived its deadline)."""
        worker = self._worker
        return self._starter.is_alive() or (worker is not None and worker.is_alive())

    def _submit(self, kind: str, payload: dict) -> int:
        job = _Job(next(self._ids), kind, payload)
        announce = False  # a load submitted while torch is still being imported says so at once
        with self._lock:
            if self._closed:
                return job.id  # quitting: nothing runs any more
            if self._worker is not None:
                self._pending[job.id] = job
                self._send(job)
                return job.id
            if self._import_error is None:
                self._pending[job.id] = job
                self._early.append(job)
                announce = payload["announced"] = kind == "load" and payload.get("engine") is None
        if self._import_error is not None:
            self._report_failure(job, self._import_error)
        elif announce:
            self.model_loading.emit(payload["what"])
            self.load_stage_changed.emit("Starting PyTorch and transformers…")
        return job.id

    # -- the starter thread --------------------------------------------------------------------------------
    def _start_worker(self) -> None:
        try:
            import_engine()  # torch and transformers: seconds, kept off the UI thread
            from engine import EngineWorker
        except Exception as exc:  # a broken install: every job fails with the reason, the window stays
            log.exception("the engine could not be imported")
            with self._lock:
                self._import_error = exc
                early, self._early = self._early, []
            for job in early:
                self._pending.pop(job.id, None)
                self._report_failure(job, exc)
            return
        with self._lock:
            if self._closed:
                return
            self._worker = EngineWorker(name="kvboost-engine")
            for job in self._early:
                self._send(job)
            self._early = []

    def _send(self, job: _Job) -> None:
        """Submits `job` to the worker (called with the lock held, so jobs keep their order)."""
        handlers = {"load": self._run_load, "chat": self._run_chat, "warm": self._run_warm}
        run = handlers[job.kind]
        # A chat job returns its request stream, which the worker decodes in one batch with the other tabs' and
        # the API's requests; its events come to _chat_event.
        sink = (lambda event: self._chat_event(job, event)) if job.kind == "chat" else None
        self._worker.submit(lambda cancel: run(job), source=SOURCE, cancel=job.cancel, sink=sink,
                            on_done=lambda done: self._ended(job, done))

    # -- worker thread -------------------------------------------------------------------------------------
    def _ended(self, job: _Job, done) -> None:
        """A job has ended (on the worker; for jobs still waiting at shutdown, on the UI thread): failures and
        jobs that never ran are reported here, the rest reported themselves."""
        self._pending.pop(job.id, None)
        if self._closed:
            return
        if done.state == done.SKIPPED:
            if job.kind == "chat":
                self.generation_finished.emit(job.id, {"text": "", "finish_reason": "cancelled", "stats": None,
                                                       "segments": [], "saved_ms": 0.0})
            elif job.kind == "warm":
                self.warm_finished.emit(job.id, _warm_totals(cancelled=True))
            else:
                self.model_load_cancelled.emit()
        elif done.state == done.FAILED:
            from engine import Cancelled

            if job.kind == "load" and isinstance(done.error, Cancelled):  # stopped between stages: no failure
                log.info("model load cancelled")
                self.model_load_cancelled.emit()
            else:
                self._report_failure(job, done.error)

    def _report_failure(self, job: _Job, exc: BaseException) -> None:
        """The one failure path: logged, then the job's failure signal (the worker goes on)."""
        log.error("engine job %s (%s) failed", job.id, job.kind, exc_info=exc)
        message = _describe(exc)
        if job.kind == "load":
            self.model_load_failed.emit(message)
        elif job.kind == "chat":
            self.generation_failed.emit(job.id, message)
        else:
            self.warm_failed.emit(job.id, message)

    def _run_load(self, job: _Job) -> None:
        source = job.payload.get("source")
        t0 = time.perf_counter()
        self._engine = None  # the old model goes before the new one is read, so two never share memory
        self._info = None
        engine = job.payload.get("engine")
        if engine is None:
            log.info("loading the model: %s", job.payload["what"])
            if not job.payload.get("announced"):
                self.model_loading.emit(job.payload["what"])
                self.load_stage_changed.emit("Starting PyTorch and transformers…")
            from engine import KVBoost

            self.load_stage_changed.emit("Reading and preparing the weights…")
            engine = KVBoost.from_pretrained(source, quiet=True, cancel=job.cancel, progress=self.load_progressed.emit,
                                             **job.payload["options"])
        self._engine = engine
        self._prefill_rates = []  # another model: another rate
        info = engine.info().to_dict()  # handed on to the window as a dict (model_loaded)
        from engine.weights.weights_report import describe_weights

        self._info = dict(info, source=source, disk_cache=info["cache_folder"], load_s=time.perf_counter() - t0,
                          weights_text=describe_weights(info["weights"]))
        self.model_loaded.emit(dict(self._info))

    def _require_engine(self):
        if self._engine is None:
            raise RuntimeError("no model is loaded")
        return self._engine

    def _run_chat(self, job: _Job):
        engine = self._require_engine()
        ids = engine.encode(job.payload["messages"])
        job.payload["running_engine"], job.payload["ids"] = engine, ids
        self.generation_started.emit(job.id)
        return engine.stream(ids, cancel=job.cancel, **job.payload["sampling"])

    def _chat_event(self, job: _Job, event) -> None:
        """A chat job's TokenEvent or Result (on the worker's thread)."""
        from engine import Result

        if not isinstance(event, Result):
            if event.text:
                self.token_generated.emit(job.id, event.text)
            return
        engine, ids, result = job.payload["running_engine"], job.payload["ids"], event
        stats = result.stats
        segments = [{"start": s, "end": e, "kind": kind, "text": engine.decode(ids[s:e])}
                    for s, e, kind in stats.chunks]
        if stats.repair == "none":  # a blend pass computes tokens outside the timed forwards
            self._calibrate(stats.prefill_ms, stats.recomputed_tokens)
        rate = self.prefill_ms_per_token()
        self.generation_finished.emit(job.id, {
            "text": result.text,
            "finish_reason": result.finish_reason,
            "stats": stats.to_dict(),
            "segments": segments,
            # Estimate: a full prefill would also have computed the reused tokens at the measured rate (None
            # until a mostly computed request or a pre-warm has measured it).
            "saved_ms": stats.reused_tokens * rate if rate else None,
        })

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

    def _run_warm(self, job: _Job) -> None:
        engine = self._require_engine()
        texts = job.payload["texts"]
        totals = _warm_totals(cancelled=False)
        for i, text in enumerate(texts):
            if job.cancel.is_set():
                totals["cancelled"] = True
                break
            report = engine.warm(text)
            self._calibrate(report["prefill_ms"], report["computed_tokens"])
            for key in ("tokens", "computed_tokens", "reused_tokens", "ms", "prefill_ms"):
                totals[key] += report[key]
            totals["done"] = i + 1
            self.warm_progressed.emit(job.id, i + 1, len(texts))
        self.warm_finished.emit(job.id, totals)


def _warm_totals(cancelled: bool) -> dict:
    return {"tokens": 0, "computed_tokens": 0, "reused_tokens": 0, "ms": 0.0, "prefill_ms": 0.0, "done": 0,
            "cancelled": cancelled}


def _describe(exc: BaseException) -> str:
    """A message for the UI: the project's errors (all ValueErrors) already say what and why; others get
    their type."""
    if isinstance(exc, ValueError):
        return str(exc)
    if isinstance(exc, MemoryError) or "out of memory" in str(exc).lower():
        return f"Out of memory: {exc}. Try a smaller model, a shorter prompt or fewer documents."
    return f"{type(exc).__name__}: {exc}"
