"""Reading dropped files in worker processes, so that one which takes too long or too much memory can be stopped.

A dropped file's bytes are nobody's promise: a zip bomb or a crafted PDF can keep a parser busy for hours or
make it take all memory. `documents.extract` refuses what it can see up front (file size, a .docx's unpacked
size); the rest is bounded here. Each file is read in a worker process under a wall-clock limit (past it the
worker is killed) and, on Linux, an address-space limit (RLIMIT_AS, set in the worker around each file); a
cancelled read kills its worker at once. Either way the caller gets a DocumentError naming the file and why.

Workers are started with "spawn", never fork: the app process holds torch and Qt threads, which a forked child
would inherit half-alive. Starting one costs about a second (a fresh interpreter importing the parsers), so
workers are reused across files; one that was killed or ran out of memory is replaced by a fresh one on the
next file.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path

from . import documents
from .documents import DocumentError, ExtractedDocument

_MB = 1024 * 1024
_POLL_S = 0.05  # how often a waiting read looks at its cancel event
_START_TIMEOUT_S = 120.0  # a fresh worker imports the parsers; generous for a busy machine
_MEMORY_LIMITS = sys.platform.startswith("linux")  # RLIMIT_AS is not enforced on macOS; Windows has no rlimits


@dataclass(frozen=True)
class ExtractionLimits:
    max_bytes: int = documents.MAX_FILE_BYTES
    max_unpacked_bytes: int = documents.MAX_UNPACKED_BYTES
    max_compression_ratio: float = documents.MAX_COMPRESSION_RATIO
    passage_chars: int = 1000
    timeout_s: float = 120.0  # wall clock for one file, from when the worker gets it
    max_memory_bytes: int = 2048 * _MB  # address space a file may add to the worker's own (Linux only)


class ExtractionCancelled(DocumentError):
    """The read was cancelled; the worker reading the file was stopped."""


@dataclass
class _Worker:
    process: multiprocessing.process.BaseProcess
    connection: Connection


class ExtractionPool:
    """Worker processes that read files; thread-safe, one file per worker at a time.

    `num_idle` workers are kept between files. Files read at once each take a worker of their own (the app
    reads at most two at a time), so a busy pool starts more.
    """

    def __init__(self, *, num_idle: int = 2):
        self.num_idle = num_idle
        self.num_started = 0  # worker processes started so far, replacements included
        self._context = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._busy: list[_Worker] = []
        self._closed = False

    @property
    def busy_pids(self) -> list[int]:
        """Process ids of the workers reading a file right now."""
        with self._lock:
            return [worker.process.pid for worker in self._busy]

    def extract(self, path: str | Path, limits: ExtractionLimits = ExtractionLimits(),
                cancelled: threading.Event | None = None) -> ExtractedDocument:
        """`documents.extract(path)` in a worker, within `limits`. Blocks until it is done; setting `cancelled`
        stops the worker and raises ExtractionCancelled. Every failure is a DocumentError naming the file."""
        name = documents.display_name(path)
        worker = self._take_worker(name, cancelled)
        healthy = False
        try:
            try:
                worker.connection.send((str(path), limits))
            except (OSError, ValueError):  # it died since it was taken
                self._kill(worker)
                raise DocumentError(f"{name} was not read: the reader stopped unexpectedly; try again") from None
            kind, value = self._reply(worker, name, limits, cancelled)
            healthy = kind != "memory"  # the worker exits after running out: its heap may be damaged
        finally:
            self._give_back(worker, healthy)
        if kind == "ok":
            return value
        if kind == "memory":
            raise DocumentError(
                f"{name} needs more than {limits.max_memory_bytes // _MB} MB of memory to read; it may be damaged or "
                "built to exhaust memory"
            )
        raise DocumentError(value)

    def close(self) -> None:
        """Stop every worker, busy ones too (their reads fail); the pool starts no more."""
        with self._lock:
            self._closed = True
            workers, self._idle = self._idle + self._busy, []
        for worker in workers:
            _stop(worker)

    # -- internals --------------------------------------------------------------------------------------

    def _take_worker(self, name: str, cancelled: threading.Event | None) -> _Worker:
        with self._lock:
            if self._closed:
                raise DocumentError(f"{name} was not read: the app is shutting down")
            while self._idle:
                worker = self._idle.pop()
                if worker.process.is_alive():
                    self._busy.append(worker)
                    return worker
                _stop(worker)
            self.num_started += 1
        worker = self._start_worker(name, cancelled)
        with self._lock:
            self._busy.append(worker)
        return worker

    def _start_worker(self, name: str, cancelled: threading.Event | None) -> _Worker:
        ours, theirs = self._context.Pipe(duplex=True)
        process = self._context.Process(target=_serve, args=(theirs,), name="kvboost-document-reader", daemon=True)
        try:
            process.start()
        except (OSError, RuntimeError) as error:  # out of processes or memory; a frozen app without freeze_support
            ours.close()
            raise DocumentError(f"{name} was not read: the process that reads documents could not start "
                                f"({' '.join(str(error).split())[:200]})") from None
        finally:
            theirs.close()
        worker = _Worker(process, ours)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not (cancelled is not None and cancelled.is_set()) and time.monotonic() < deadline:
            if not wait([ours, process.sentinel], timeout=_POLL_S):
                continue
            try:
                if ours.recv() == "ready":
                    return worker
            except (EOFError, OSError):
                pass
            break
        _stop(worker)
        if cancelled is not None and cancelled.is_set():
            raise ExtractionCancelled(f"reading {name} was cancelled")
        raise DocumentError(f"{name} was not read: the process that reads documents did not start "
                            f"(exit code {process.exitcode})")

    def _reply(self, worker: _Worker, name: str, limits: ExtractionLimits,
               cancelled: threading.Event | None) -> tuple[str, object]:
        deadline = time.monotonic() + limits.timeout_s
        while True:
            if cancelled is not None and cancelled.is_set():
                self._kill(worker)
                raise ExtractionCancelled(f"reading {name} was cancelled")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._kill(worker)
                raise DocumentError(f"{name} took longer than {limits.timeout_s:g} s to read; it may be damaged or "
                                    "built to hang readers")
            ready = wait([worker.connection, worker.process.sentinel], timeout=min(remaining, _POLL_S))
            if worker.connection in ready:
                try:
                    return worker.connection.recv()
                except (EOFError, OSError):
                    pass  # the worker died; its exit code says how
            if ready:
                self._kill(worker)
                raise DocumentError(f"{name} could not be read: the reader stopped unexpectedly "
                                    f"({_exit_reason(worker.process.exitcode)})")

    def _kill(self, worker: _Worker) -> None:
        with self._lock:
            if worker in self._busy:
                self._busy.remove(worker)
        worker.process.kill()
        worker.process.join(timeout=10)
        worker.connection.close()

    def _give_back(self, worker: _Worker, healthy: bool) -> None:
        with self._lock:
            if worker not in self._busy:  # killed already
                return
            self._busy.remove(worker)
            if healthy and not self._closed and len(self._idle) < self.num_idle:
                self._idle.append(worker)
                return
        _stop(worker)


def _stop(worker: _Worker) -> None:
    """End a worker: closing its pipe makes an idle one exit; one that does not in a moment is killed."""
    worker.connection.close()
    worker.process.join(timeout=2)
    if worker.process.is_alive():
        worker.process.kill()
        worker.process.join(timeout=10)


def _exit_reason(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"killed by signal {-exitcode}; the computer may have run out of memory"
    return f"exit code {exitcode}"


_shared: ExtractionPool | None = None
_shared_lock = threading.Lock()


def shared_pool() -> ExtractionPool:
    """The app's pool, started on first use and stopped when the app exits."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = ExtractionPool()
            atexit.register(_shared.close)
        return _shared


# -- the worker process ------------------------------------------------------------------------------------


def _serve(connection: Connection) -> None:
    """A worker's main loop: read the files it is sent, one at a time, until its pipe closes."""
    connection.send("ready")
    while True:
        try:
            path, limits = connection.recv()
        except (EOFError, OSError):
            return
        reply = _extract_within(path, limits)
        connection.send(reply)
        if reply[0] == "memory":
            return


def _extract_within(path: str, limits: ExtractionLimits) -> tuple[str, object]:
    """("ok", document) | ("error", message for the user) | ("memory", None)."""
    restore = _limit_memory(limits.max_memory_bytes)
    try:
        document = documents.extract(path, max_bytes=limits.max_bytes, max_unpacked_bytes=limits.max_unpacked_bytes,
                                     max_compression_ratio=limits.max_compression_ratio,
                                     passage_chars=limits.passage_chars)
        return "ok", document
    except DocumentError as error:
        return "error", str(error)
    except MemoryError:
        return "memory", None
    except Exception as error:  # noqa: BLE001  (a parser bug on a strange file is that file's problem)
        return "error", f"{documents.display_name(path)} could not be read ({type(error).__name__}: {error})"
    finally:
        restore()


def _limit_memory(max_bytes: int):
    """Cap this process's address space at what it uses now + max_bytes; returns what undoes it."""
    if not _MEMORY_LIMITS:
        return lambda: None
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as statm:
        in_use = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    cap = in_use + max_bytes
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    return lambda: resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
