"""The app's only door to the engine.

EngineClient lives on the UI thread: it says which backend answers (app.backends: this process's engine on its
one worker thread, or a remote OpenAI-compatible server), hands out one request handle per answer or pre-warm
(app.answers: only the tab that asked hears its signals), and reports model loads and the in-process API server
through its own signals, which Qt queues to the UI thread: slots always run there.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

from PySide6.QtCore import QObject, QTimer, Signal

from .answers import ChatRequest, WarmRequest
from .backends import LocalBackend, RemoteBackend, describe, import_engine
from .background import Background, start_thread

log = logging.getLogger(__name__)


class EngineClient(QObject):
    model_loading = Signal(str)  # what is being loaded
    load_stage_changed = Signal(str)
    load_progressed = Signal(int, int, str)  # steps done, steps in all (0: unknown), what was just done
    model_loaded = Signal(dict)  # model_info
    model_load_failed = Signal(str)
    model_load_cancelled = Signal()  # the load was stopped (quitting): nothing to report, no model loaded
    server_started = Signal(str)  # base URL of the OpenAI-compatible API
    server_stopped = Signal()
    server_failed = Signal(str)
    weights_estimated = Signal(str, dict)  # source ("" for the built-in model), engine.weights.weight_sizes.estimate

    def __init__(self, parent=None, engine_options: dict | None = None):
        """`engine_options`: from_pretrained options applied to every load (the app's KV cache folder)."""
        super().__init__(parent)
        self._engine_options = dict(engine_options or {})
        self._pending: dict[int, ChatRequest | WarmRequest] = {}  # handed out and not ended, by id
        self._ids = itertools.count(1)
        self._info: dict | None = None
        self._server = None  # (server.thread.ServerThread, url) of the in-process API server
        self._closed = False  # shutdown() was called: no more requests, no more signals about them
        self._load_cancel = None  # the running or waiting load's cancel event
        self._local = LocalBackend(self._LoadEvents(self))
        self._remote: RemoteBackend | None = None  # while answers come from a server
        self._background = Background(self)

    class _LoadEvents:
        """The local backend's load reports, as this client's signals."""

        def __init__(self, client: "EngineClient"):
            self._client = client

        def starting(self) -> None:
            self._client._info = None  # the old model is going

        def loading(self, what: str, stage: str) -> None:
            if not self._client._closed:
                self._client.model_loading.emit(what)
                self._client.load_stage_changed.emit(stage)

        def stage(self, text: str) -> None:
            self._client.load_stage_changed.emit(text)

        def progressed(self, done: int, total: int, what: str) -> None:
            self._client.load_progressed.emit(done, total, what)

        def loaded(self, engine, source, load_s: float) -> None:
            from engine.weights.weights_report import describe_weights

            report = engine.info()
            info = report.to_dict()
            self._client._info = dict(info, source=source, disk_cache=info["cache_folder"], load_s=load_s,
                                      weights_text=describe_weights(report.weights))
            self._client.model_loaded.emit(dict(self._client._info))

        def failed(self, message: str) -> None:
            self._client.model_load_failed.emit(message)

        def cancelled(self) -> None:
            if not self._client._closed:
                self._client.model_load_cancelled.emit()

    # -- UI-thread API -------------------------------------------------------------------------------------
    @property
    def is_loaded(self) -> bool:
        return self._local.engine is not None or self._remote is not None

    @property
    def model_info(self) -> dict | None:
        return self._info

    @property
    def backend(self) -> LocalBackend | RemoteBackend:
        """Who answers chat() and warm() now."""
        return self._remote if self._remote is not None else self._local

    def load_model(self, source: str | None = None, **options) -> None:
        """Loads `source` (None: the embedded default) with engine options (reuse, layer_streaming, ...)."""
        self._use_local()  # answers come from the engine again (chats sent from now on queue behind the load)
        if self._closed:
            return
        self._load_cancel = threading.Event()
        self._local.load(source, {**self._engine_options, **options}, source or "SmolLM2-135M-Instruct (built in)",
                         self._load_cancel)

    def use_engine(self, engine) -> None:
        """Adopts an already loaded engine (tests share one model this way; the engine must not be used
        elsewhere while this client runs it)."""
        self._use_local()
        self._local.adopt(engine)

    def _use_local(self) -> None:
        if self._remote is not None:
            self._remote.close()
            self._remote = None

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
                             lambda exc: self.weights_estimated.emit(source or "", {"error": describe(exc)}),
                             name="kvboost-weight-sizes")

    def model_library(self, **options):
        """The model library over the standard HF cache (hub.models.ModelHub; `options`: endpoint, cache_dir,
        token). Importing the engine takes seconds and the library's calls do network and disk I/O: call this and
        them off the UI thread and off the engine thread (app.models_dialog runs them on threads of its own)."""
        from hub.models import ModelHub

        return ModelHub(**options)

    @property
    def is_remote(self) -> bool:
        return self._remote is not None

    def use_remote(self, base_url: str, model: str, api_key: str | None = None, *, max_context: int = 8192) -> None:
        """Answers come from `model` on the OpenAI-compatible server at `base_url` from now on (load_model goes
        back to the engine); model_loaded follows with info that says so. A model the engine holds stays loaded
        until the next load_model."""
        from .remote_provider import RemoteProvider

        self._use_local()
        self._remote = RemoteBackend(RemoteProvider(base_url, api_key), model)
        self._info = {"name": model, "remote": True, "base_url": base_url, "device": f"remote {base_url}",
                      "dtype": "remote", "max_context": max_context, "reuse": "remote", "load_s": 0.0,
                      "source": None}
        self.model_loaded.emit(dict(self._info))

    def chat(self, messages: list[dict], sampling: dict | None = None) -> ChatRequest:
        """Asks for an answer to `messages`; the handle's signals (started, token, finished(Answer), failed)
        reach whoever holds it. After shutdown() the handle never reports."""
        return self._hand_out(ChatRequest(next(self._ids)),
                              lambda request: self.backend.chat(request, messages, dict(sampling or {})))

    def warm(self, texts: list) -> WarmRequest:
        """Pre-fills each text (a string or a message list) so later prompts containing it reuse its KV; the
        handle reports progressed(done, total), then finished(WarmReport) or failed."""
        return self._hand_out(WarmRequest(next(self._ids)), lambda request: self.backend.warm(request, list(texts)))

    def _hand_out(self, request, submit):
        if self._closed:
            return request
        self._pending[request.id] = request
        request.finished.connect(lambda *_: self._pending.pop(request.id, None))
        request.failed.connect(lambda *_: self._pending.pop(request.id, None))
        submit(request)
        return request

    def cancel_all(self) -> None:
        for request in list(self._pending.values()):
            request.cancel()
        if self._load_cancel is not None:
            self._load_cancel.set()

    def memory(self) -> dict | None:
        """Engine memory report (weights, KV per tier, device totals); None before a model is loaded."""
        engine = self._local.engine
        return engine.memory().to_dict() if engine is not None else None

    def prefill_ms_per_token(self) -> float | None:
        """What a prefill token has cost this session (app.backends.LocalBackend.prefill_ms_per_token)."""
        return self._local.prefill_ms_per_token()

    # -- the OpenAI-compatible API over the loaded model (server.thread), in this process ------------------
    @property
    def server_url(self) -> str | None:
        return self._server[1] if self._server is not None else None

    def start_server(self, port: int = 8000, api_key: str | None = None) -> None:
        """Serves the loaded engine on 127.0.0.1:`port` (HTTP on a thread of its own); server_started(url) or
        server_failed(reason) follows. The API's requests run on this client's worker, taking turns with the
        window's, so the model is loaded once and one thread runs torch."""
        engine, worker = self._local.engine, self._local.worker
        if engine is None or worker is None:
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
        running = ServerThread(engine, model_id=model_id, worker=worker, port=port, api_key=api_key).start()
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
        """Stops the API server, cancels every request (no signals about them follow) and stops the engine thread,
        waiting up to `timeout` seconds. Returns whether it ended: False when a job outlived the deadline (a
        model load inside one long stage, or torch still being imported)."""
        self.stop_server()
        self._closed = True
        for request in self._pending.values():
            request.silence()
        self.cancel_all()
        if self._remote is not None:
            self._remote.close()
        return self._local.close(timeout)

    def worker_alive(self) -> bool:
        """Whether the engine's threads are still running (after shutdown(): a job that outlived its deadline)."""
        return self._local.alive()
