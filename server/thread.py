"""The server in a thread of this process, on 127.0.0.1: the desktop app serves its loaded model this way, and so
do the tests and the bench (with kvboost-server's settings: the same client deadlines)."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from .app import create_app
from .guard import Timeouts, server_options


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """create_app(engine, ...) served by uvicorn from a daemon thread. start() returns at once; `started` and
    `alive` tell how it goes (a port in use ends the thread), wait_started() blocks for it. stop() cancels the
    server's running and waiting requests and ends the thread. `worker`: the EngineWorker that runs this
    engine for its other users (the desktop app's); requests then take turns with theirs on its one thread,
    and stop() leaves it and their jobs running. None: the server has a worker of its own, stopped with it,
    decoding up to `max_batch` requests at once (engine.batching; 1: one at a time)."""

    def __init__(self, engine, *, model_id: str, worker=None, port: int | None = None, api_key: str | None = None,
                 timeouts: Timeouts = Timeouts(), name: str = "kvboost-api", max_batch: int | None = None):
        self.port = port if port is not None else free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        options = {} if max_batch is None else {"max_batch": max_batch}  # for a worker of its own
        self.app = create_app(engine, model_id=model_id, worker=worker, api_key=api_key, timeouts=timeouts, **options)
        self._server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                     log_level="warning", **server_options(timeouts)))
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        try:
            self._server.run()
        except SystemExit:  # uvicorn exits this way when it cannot listen; `alive` turns False
            pass

    @property
    def scheduler(self):
        return self.app.state.scheduler

    @property
    def started(self) -> bool:
        return bool(self._server.started)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> "ServerThread":
        self._thread.start()
        return self

    def wait_started(self, timeout_s: float = 30) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.started:
            if not self.alive or time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def stop(self, timeout_s: float | None = 30) -> None:
        """Cancels the requests and asks the server to exit; joins its thread unless `timeout_s` is None."""
        self.scheduler.close()
        self._server.should_exit = True
        if timeout_s is not None:
            self._thread.join(timeout=timeout_s)

    def join(self, timeout_s: float = 30) -> None:
        self._thread.join(timeout=timeout_s)
