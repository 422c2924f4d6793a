"""A real server on a free loopback port, over a real engine, in a thread of this process."""

from __future__ import annotations

import time

from server.thread import free_port  # noqa: F401  (tests import it from here)


class RunningServer:
    """Served as `kvboost-server` serves it (server.app's settings, `timeouts` included), started and waited for."""

    def __init__(self, engine, model_id="smollm2", api_key=None, timeouts=None, max_batch=None):
        from server.app import Timeouts
        from server.thread import ServerThread

        self.engine = engine
        self._thread = ServerThread(engine, model_id=model_id, api_key=api_key, timeouts=timeouts or Timeouts(),
                                    max_batch=max_batch)
        self.app, self.port, self.url = self._thread.app, self._thread.port, self._thread.url
        self._thread.start()
        assert self._thread.wait_started(30), "server did not start"

    @property
    def scheduler(self):
        return self.app.state.scheduler

    def stop(self) -> None:
        self._thread.stop()


class EngineBusy:
    """The engine generating for someone else, on the test's thread: from `__enter__` to `__exit__` it holds the
    engine (a real generation, paused between two tokens), so the job the server's worker has taken waits for it
    and the others wait in the queue."""

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


def wait_healthy(proc, url: str, timeout_s: float = 180) -> None:
    """Waits for a kvboost-server process to answer GET /health (which needs no key); fails with its stderr if it
    exits first."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        assert time.monotonic() < deadline, "the server did not come up"
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.5)


def wait_until(condition, timeout_s: float = 30, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
