"""A real server on a free loopback port, over a real engine, in a thread of this process."""

from __future__ import annotations

import socket
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    """Served as `kvboost-server` serves it (engine.server.serve's settings), `timeouts` included."""

    def __init__(self, engine, model_id="smollm2", api_key=None, timeouts=None):
        import uvicorn

        from engine.server import Timeouts, create_app, server_options

        timeouts = timeouts or Timeouts()
        self.engine = engine
        self.app = create_app(engine, model_id=model_id, api_key=api_key, timeouts=timeouts)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                     log_level="warning", **server_options(timeouts)))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)

    @property
    def scheduler(self):
        return self.app.state.scheduler

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self.scheduler.close()


class EngineBusy:
    """The engine generating for someone else, as the desktop app does on the engine it shares with the server:
    from `__enter__` to `__exit__` it holds the engine (a real generation, paused between two tokens), so the
    server's jobs wait for it in its queue."""

    def __init__(self, engine):
        self.engine = engine
        self._generation = None

    def __enter__(self):
        self._generation = self.engine.stream("Count from one to one thousand:", max_new_tokens=4000,
                                              temperature=0)
        next(self._generation)  # its first token is out: the engine is taken until the generation is closed
        return self

    def __exit__(self, *exc):
        self._generation.close()


def wait_until(condition, timeout_s: float = 30, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
