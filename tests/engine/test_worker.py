"""EngineWorker with real threads and real jobs: order (FIFO within a source, sources in turn), cancel before and
during a job, failures on their handle, stop() with a deadline, and a real tiny engine streamed through it."""

from __future__ import annotations

import threading
import time

import pytest
from tiny_models import CHUNK, build_model, build_tokenizer, random_ids

from engine import EngineConfig, KVBoost, Result, TokenEvent
from engine.worker import FAILED, FINISHED, SKIPPED, EngineWorker, WorkerStopped

WAIT_S = 30


@pytest.fixture
def worker():
    w = EngineWorker(name="test-engine")
    yield w
    w.stop(deadline_s=WAIT_S)


class Ledger:
    """Jobs that record their name and the thread they ran on, in the order they ran."""

    def __init__(self):
        self.ran: list[str] = []
        self.threads: set[int] = set()

    def job(self, name: str):
        def run(cancel):
            self.ran.append(name)
            self.threads.add(threading.get_ident())
        return run


def hold(worker, source: str = "default"):
    """Submits a job that keeps the worker busy until the returned event is set, and waits until it runs."""
    gate, started = threading.Event(), threading.Event()

    def blocker(cancel):
        started.set()
        assert gate.wait(WAIT_S)

    worker.submit(blocker, source=source)
    assert started.wait(WAIT_S)
    return gate


def test_jobs_of_one_source_run_in_submission_order_on_the_worker_thread(worker):
    ledger = Ledger()
    gate = hold(worker)
    jobs = [worker.submit(ledger.job(f"j{i}")) for i in range(6)]
    assert worker.num_waiting() == 6
    gate.set()
    assert all(job.wait(WAIT_S) for job in jobs)
    assert ledger.ran == [f"j{i}" for i in range(6)]
    assert ledger.threads == {worker.thread_id} and worker.thread_id != threading.get_ident()
    assert [job.state for job in jobs] == [FINISHED] * 6


def test_sources_take_turns_so_a_busy_client_cannot_starve_another(worker):
    ledger = Ledger()
    gate = hold(worker, source="api")  # the API's first request is running
    api = [worker.submit(ledger.job(f"api{i}"), source="api") for i in range(1, 6)]
    window = [worker.submit(ledger.job(f"window{i}"), source="window") for i in range(1, 3)]
    assert worker.num_waiting("api") == 5 and worker.num_waiting("window") == 2
    gate.set()
    assert all(job.wait(WAIT_S) for job in api + window)
    # The window's first job goes before the API's second waiting one, though it was queued after all five.
    assert ledger.ran == ["window1", "api1", "window2", "api2", "api3", "api4", "api5"]


def test_a_job_cancelled_before_it_starts_never_runs(worker):
    ledger = Ledger()
    ended = []
    gate = hold(worker)
    skipped = worker.submit(ledger.job("skipped"), on_done=lambda job: ended.append((job.id, job.state)))
    after = worker.submit(ledger.job("after"))
    skipped.cancel()
    gate.set()
    assert after.wait(WAIT_S) and skipped.done
    assert ledger.ran == ["after"]
    assert skipped.state == SKIPPED and ended == [(skipped.id, SKIPPED)]
    assert list(skipped) == []  # its handle ends without events


def test_cancelling_a_running_job_sets_the_event_it_checks(worker):
    def ticks(cancel):
        for i in range(100_000):
            if cancel.is_set():
                yield "stopped"
                return
            yield i
            time.sleep(0.001)

    job = worker.submit(ticks)
    seen = []
    for event in job:
        seen.append(event)
        if len(seen) == 3:
            job.cancel()
    assert seen[:3] == [0, 1, 2] and seen[-1] == "stopped" and len(seen) < 100
    assert job.state == FINISHED and job.cancelled


def test_an_exception_reaches_its_handle_and_the_next_job_runs(worker):
    def broken(cancel):
        yield "first"
        raise ValueError("the weights are missing")

    failed = worker.submit(broken)
    after = worker.submit(lambda cancel: iter(["next"]))
    seen = []
    with pytest.raises(ValueError, match="the weights are missing"):
        for event in failed:
            seen.append(event)
    assert seen == ["first"] and failed.state == FAILED and isinstance(failed.error, ValueError)
    assert list(after) == ["next"] and after.state == FINISHED


def test_events_can_go_to_a_sink_on_the_worker_thread(worker):
    received = []
    job = worker.submit(lambda cancel: iter([1, 2, 3]),
                        sink=lambda event: received.append((event, threading.get_ident())))
    assert job.wait(WAIT_S)
    assert received == [(1, worker.thread_id), (2, worker.thread_id), (3, worker.thread_id)]
    with pytest.raises(RuntimeError, match="sink"):
        list(job)


def test_stop_with_a_stuck_job_returns_false_by_its_deadline_and_skips_the_waiting(worker):
    stuck_gate, started = threading.Event(), threading.Event()

    def stuck(cancel):  # ignores its cancel, as a model load inside one long stage does
        started.set()
        stuck_gate.wait(WAIT_S)

    running = worker.submit(stuck)
    assert started.wait(WAIT_S)
    waiting = worker.submit(lambda cancel: pytest.fail("a waiting job ran after stop()"))
    t0 = time.monotonic()
    assert worker.stop(deadline_s=0.3) is False
    assert 0.25 < time.monotonic() - t0 < 5
    assert running.cancelled and waiting.state == SKIPPED and waiting.done
    assert worker.is_alive()
    stuck_gate.set()  # the stage ends: the thread ends with it
    assert running.wait(WAIT_S) and running.state == FINISHED
    assert worker.stop(deadline_s=WAIT_S) is True and not worker.is_alive()


def test_stop_cancels_the_running_job_and_the_thread_ends(worker):
    def until_cancelled(cancel):
        yield "started"
        cancel.wait(WAIT_S)

    job = worker.submit(until_cancelled)
    assert next(iter(job)) == "started"
    assert worker.stop(deadline_s=WAIT_S) is True
    assert job.cancelled and job.state == FINISHED and not worker.is_alive()


def test_submit_after_stop_raises(worker):
    assert worker.stop(deadline_s=WAIT_S)
    with pytest.raises(WorkerStopped):
        worker.submit(lambda cancel: None)


# -- a real engine through the worker ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_engine(one_thread):
    return KVBoost(build_model("llama"), build_tokenizer(),
                   EngineConfig.of(chunk_size=CHUNK, disk_cache_bytes=0, reuse="off"))


def test_a_real_engine_streams_from_the_worker_as_it_does_directly(worker, tiny_engine):
    prompt = random_ids(3 * CHUNK + 5, seed=3)
    direct = tiny_engine.generate(prompt, max_new_tokens=10, temperature=0)
    threads = []

    def chat(cancel):
        threads.append(threading.get_ident())
        return tiny_engine.stream(prompt, cancel=cancel, max_new_tokens=10, temperature=0)

    events = list(worker.submit(chat))
    assert threads == [worker.thread_id]
    assert all(isinstance(e, TokenEvent) for e in events[:-1]) and isinstance(events[-1], Result)
    assert events[-1].token_ids == direct.token_ids and events[-1].finish_reason == "length"


def test_a_real_generation_cancelled_mid_way_ends_cancelled(worker, tiny_engine):
    job = worker.submit(lambda cancel: tiny_engine.stream(random_ids(20, seed=4), cancel=cancel,
                                                          max_new_tokens=1500, temperature=0))
    events = []
    for event in job:
        events.append(event)
        if len(events) == 3:
            job.cancel()
    result = events[-1]
    assert isinstance(result, Result) and result.finish_reason == "cancelled"
    assert 3 <= len(result.token_ids) < 1500


def test_a_sink_that_fails_closes_the_generation_so_the_engine_serves_the_next(worker, tiny_engine):
    def sink(event):
        raise ConnectionError("the client went away")

    failed = worker.submit(lambda cancel: tiny_engine.stream(random_ids(20, seed=5), cancel=cancel,
                                                             max_new_tokens=50), sink=sink)
    assert failed.wait(WAIT_S) and failed.state == FAILED and isinstance(failed.error, ConnectionError)
    # Left open, the first stream would hold the engine: the next one on this thread would be refused.
    events = list(worker.submit(lambda cancel: tiny_engine.stream(random_ids(20, seed=6), cancel=cancel,
                                                                  max_new_tokens=4)))
    assert events[-1].finish_reason == "length"
