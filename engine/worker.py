"""The one thread that runs torch for an engine, and its job queue.

Front ends (the desktop app, the HTTP server) never call the engine from their own threads: they `submit` a job
to an EngineWorker and get the job's events back. A job is a function of its cancel event, called on the
worker's thread; what it returns (None, or an iterable such as `engine.stream(...)`) is iterated there and each
item handed to the job's sink, or queued for whoever iterates the Job handle.

    job = worker.submit(lambda cancel: engine.stream(ids, cancel=cancel), source="api")
    for event in job:            # from any thread: TokenEvents, then the Result
        ...

Order: FIFO within a source; between sources, the one served least recently goes next (round robin), so one
client that queues many requests cannot starve another.

Batching: a job whose function returns a request stream that can be batched (KVBoost.stream's RequestStream,
engine.batching) does not run to its end before the next job starts: it joins the running batch, and the worker
takes the next waiting job at once. Between jobs taken, the batch takes one step: one forward pass decodes a
token (and its drafts) for every request in it, a newcomer's prefill runs one piece per step. So requests from
the window's tabs and the API arriving while others decode join at the next step, up to `max_batch` at once;
past that, jobs wait in their queue. Any other job (a model load, a warm-up) runs whole between two steps.

Cancel: a job cancelled before it starts never runs (its state is SKIPPED); cancelling a running one sets its
event, which the engine checks at every decode step.
A job that raises ends FAILED with the exception on its handle; the worker goes on with the next one.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from typing import Any, Callable, Iterable

from .batching import MAX_BATCH, Batch

log = logging.getLogger(__name__)

_END = object()  # the last item in a handle's event queue


class WorkerStopped(RuntimeError):
    """submit() on a worker that has been stopped."""


class Job:
    """A submitted job: its state, its cancel event, and its events (iterate it, once, from one thread, unless
    they go to a sink). `state` moves WAITING -> RUNNING -> FINISHED | FAILED, or WAITING -> SKIPPED.
    `submitted` and `started` are perf_counter() times (started: None until it runs)."""

    WAITING, RUNNING, FINISHED, FAILED, SKIPPED = "waiting", "running", "finished", "failed", "skipped"

    def __init__(self, job_id: int, fn: Callable[[threading.Event], Iterable | None], source: str,
                 cancel: threading.Event | None, sink: Callable[[Any], None] | None,
                 on_done: Callable[["Job"], None] | None):
        self.id = job_id
        self.source = source
        self.cancel_event = cancel if cancel is not None else threading.Event()
        self.state = WAITING
        self.error: BaseException | None = None
        self.submitted = time.perf_counter()
        self.started: float | None = None
        self._fn = fn
        self._sink = sink
        self._on_done = on_done
        self._events: queue.SimpleQueue | None = queue.SimpleQueue() if sink is None else None
        self._done = threading.Event()

    def __repr__(self) -> str:
        return f"Job({self.id}, source={self.source!r}, state={self.state!r})"

    def cancel(self) -> None:
        self.cancel_event.set()

    @property
    def queue_ms(self) -> float:
        """How long it waited before it ran (until now, while it waits; its whole wait if it never ran)."""
        return ((self.started or time.perf_counter()) - self.submitted) * 1000

    @property
    def cancelled(self) -> bool:
        return self.cancel_event.is_set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the job has ended (finished, failed or skipped); False if `timeout` passed first."""
        return self._done.wait(timeout)

    def __iter__(self):
        """The job's events as they come; at the end, the job's exception if it failed. A skipped job yields
        nothing (`state` says SKIPPED)."""
        if self._events is None:
            raise RuntimeError(f"{self!r} hands its events to its sink; they cannot also be iterated")
        while True:
            item = self._events.get()
            if item is _END:
                break
            yield item
        if self.error is not None:
            raise self.error

    # -- on the worker's thread --------------------------------------------------------------------------------
    def _deliver(self, event) -> None:
        if self._sink is not None:
            self._sink(event)
        else:
            self._events.put(event)

    def _finish(self, state: str, error: BaseException | None = None) -> None:
        self.state, self.error = state, error
        if self._events is not None:
            self._events.put(_END)
        if self._on_done is not None:
            try:
                self._on_done(self)
            except Exception:  # a front end's bookkeeping failed; the worker must go on regardless
                log.exception("on_done of %r failed", self)
        self._done.set()  # after on_done: whoever waits on the job sees its front end's bookkeeping done


WAITING, RUNNING, FINISHED, FAILED, SKIPPED = Job.WAITING, Job.RUNNING, Job.FINISHED, Job.FAILED, Job.SKIPPED


class EngineWorker:
    """One daemon thread running submitted jobs one at a time (see the module docstring for the order)."""

    def __init__(self, name: str = "kvboost-engine", max_batch: int = MAX_BATCH):
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch!r}")
        self.max_batch = max_batch
        self._batch = Batch(max_batch)
        self._in_batch: list[Job] = []  # jobs whose requests are in the batch
        self._deferred: tuple[Job, Any] | None = None  # a request on another model: joins once the batch is empty
        self._cond = threading.Condition()
        self._waiting: dict[str, deque[Job]] = {}  # by source, FIFO; a source with none waiting has no entry
        self._last_turn: dict[str, int] = {}  # source -> the turn it was last served on
        self._turns = 0
        self._ids = itertools.count(1)
        self._running: Job | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    # -- any thread ----------------------------------------------------------------------------------------------
    def submit(self, fn: Callable[[threading.Event], Iterable | None], *, source: str = "default",
               cancel: threading.Event | None = None, sink: Callable[[Any], None] | None = None,
               on_done: Callable[[Job], None] | None = None) -> Job:
        """Queues `fn(cancel_event)` to run on the worker's thread. `cancel`: the job's cancel event (a new one if
        None). `sink(event)`: receives the job's events on the worker's thread (default: the handle, for
        iterating). `on_done(job)`: called once the job has ended, on the worker's thread (for a job still
        waiting when stop() is called, on the thread calling stop). WorkerStopped after stop()."""
        with self._cond:
            if self._stopping:
                raise WorkerStopped("the engine worker has stopped; it takes no more jobs")
            job = Job(next(self._ids), fn, source, cancel, sink, on_done)  # ids in queue order: ties go by them
            self._waiting.setdefault(source, deque()).append(job)
            self._cond.notify()
        return job

    def num_waiting(self, source: str | None = None) -> int:
        with self._cond:
            if source is not None:
                return len(self._waiting.get(source, ()))
            return sum(len(jobs) for jobs in self._waiting.values())

    @property
    def running(self) -> Job | None:
        """The job running alone, else the oldest in the batch (None when the worker is idle)."""
        return self._running or next(iter(self.running_jobs), None)

    @property
    def running_jobs(self) -> list[Job]:
        """Every job running now: the one running alone, and those in the batch."""
        jobs = list(self._in_batch)
        if self._deferred is not None:
            jobs.append(self._deferred[0])
        return ([self._running] if self._running is not None else []) + jobs

    @property
    def thread_id(self) -> int | None:
        """`threading.get_ident()` of the worker's thread."""
        return self._thread.ident

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, deadline_s: float | None = 10.0) -> bool:
        """Takes no more jobs, skips the waiting ones, cancels the running one and waits up to `deadline_s` for
        the thread to end (None: as long as it takes). Returns whether it ended: False when the running job
        did not stop in time (e.g. a model load inside one long stage); the thread is a daemon and ends when
        that job returns."""
        with self._cond:
            self._stopping = True
            dropped = [job for jobs in self._waiting.values() for job in jobs]
            self._waiting.clear()
            running = self.running_jobs
            self._cond.notify_all()
        for job in running:  # batched requests end at their next step, with finish_reason "cancelled"
            job.cancel()
        for job in dropped:
            job.cancel()
            job._finish(SKIPPED)
        if threading.get_ident() == self._thread.ident:  # a job stopping its own worker cannot wait for itself
            return False
        self._thread.join(deadline_s)
        return not self._thread.is_alive()

    # -- the worker's thread -------------------------------------------------------------------------------------
    def _take(self) -> Job:
        """The next job: the head of the source served least recently (never served first; ties in arrival
        order). Called with the lock held and at least one job waiting."""
        source = min(self._waiting, key=lambda s: (self._last_turn.get(s, -1), self._waiting[s][0].id))
        jobs = self._waiting[source]
        job = jobs.popleft()
        if not jobs:
            del self._waiting[source]
        self._turns += 1
        self._last_turn[source] = self._turns
        return job

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._batch and not self._stopping:
                    self._cond.wait()
                if self._stopping and not self._batch and self._deferred is None:  # stop() took the waiting jobs
                    return
                job = None
                if self._waiting and not self._stopping and len(self._batch) < self.max_batch \
                        and self._deferred is None:
                    job = self._take()
                    if not job.cancelled:
                        job.state, job.started = RUNNING, time.perf_counter()
                        self._running = job
            if job is None:
                self._step()
                continue
            if job.state == WAITING:  # cancelled while it waited: it never runs
                job._finish(SKIPPED)
                continue
            self._run(job)

    def _step(self) -> None:
        """One batch step; then the deferred request joins if the batch has emptied."""
        self._batch.step()
        if self._deferred is not None and not self._batch:
            job, stream = self._deferred
            self._deferred = None
            self._join(job, stream)

    def _run(self, job: Job) -> None:
        events = None
        try:
            events = job._fn(job.cancel_event)
            refusal = events.batch_refusal() if hasattr(events, "batch_refusal") else "not a request stream"
            if refusal is None and self.max_batch > 1:
                with self._cond:
                    self._running = None
                if self._batch.accepts(events.engine):
                    self._join(job, events)
                else:  # another model than the batch's: it starts once the batch has finished
                    self._deferred = (job, events)
                return
            if events is not None:
                for event in events:
                    job._deliver(event)
            state, error = FINISHED, None
        except BaseException as exc:  # the job's failure (SystemExit included), on its handle; the worker goes on
            state, error = FAILED, exc
        finally:
            # A generator left by an exception (its sink's, say) is closed now, not whenever it is collected: it
            # may hold the engine's lock until then.
            close = getattr(events, "close", None)
            if close is not None and job.state == RUNNING and job not in self._in_batch \
                    and (self._deferred is None or self._deferred[0] is not job):
                try:
                    close()
                except Exception:
                    log.exception("closing the events of %r failed", job)
            with self._cond:
                self._running = None
        if job not in self._in_batch and (self._deferred is None or self._deferred[0] is not job):
            job._finish(state, error)

    def _join(self, job: Job, stream) -> None:
        self._in_batch.append(job)

        def ended(error: BaseException | None) -> None:
            self._in_batch.remove(job)
            job._finish(FINISHED if error is None else FAILED, error)

        self._batch.admit(stream.take_steps(), stream.engine, job._deliver, ended)
