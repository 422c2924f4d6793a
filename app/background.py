"""Work off the UI thread: the one module of the app that starts threads.

`Background(owner).run(fn, on_result, on_error)` runs `fn` on a thread of its own and hands its result (or the
exception it raised) to `on_result` (`on_error`) on the UI thread, through a queued signal of an object that lives
there; when `owner` is gone by then, nothing is called. `start_thread` is for work that reports by itself (a
queued signal of its own, or nothing) and `executor` for an ordered queue of such work; both make daemon threads
named after what they do (what a stack dump or a profiler shows). A test holds every other app module to this
(tests/app/test_background.py).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from PySide6.QtCore import QObject, Signal

log = logging.getLogger(__name__)


class Background(QObject):
    """Runs functions on threads of their own; results and exceptions come back on the UI thread."""

    finished = Signal(int, object, object)  # call id, result, exception

    def __init__(self, parent=None):
        super().__init__(parent)
        self._ids = itertools.count(1)
        self._callbacks: dict[int, tuple] = {}
        self.finished.connect(self._on_finished)

    def run(self, fn: Callable[[], object], on_result: Callable[[object], None],
            on_error: Callable[[Exception], None] | None = None, name: str = "kvboost-background") -> None:
        """fn() on a new thread; on_result(its value) or on_error(its exception) later on the UI thread (an
        exception without on_error is logged)."""
        call = next(self._ids)
        self._callbacks[call] = (on_result, on_error)

        def work():
            try:
                result, error = fn(), None
            except Exception as exc:  # handed to on_error, never raised into Qt
                result, error = None, exc
            try:
                self.finished.emit(call, result, error)
            except RuntimeError:  # the owner (and this object with it) is gone
                pass

        start_thread(work, name)

    def _on_finished(self, call: int, result, error) -> None:
        on_result, on_error = self._callbacks.pop(call)
        if error is None:
            on_result(result)
        elif on_error is not None:
            on_error(error)
        else:
            log.warning("background call failed: %s", error)


def start_thread(target: Callable[[], object], name: str) -> threading.Thread:
    """target() on a new daemon thread named `name` (it reports by itself, or not at all)."""
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


def executor(name: str, workers: int = 1) -> ThreadPoolExecutor:
    """A pool of `workers` threads named `name-N`: with one, its jobs run in the order they were submitted."""
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
