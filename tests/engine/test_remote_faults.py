"""The shared KV tier when its store fails: a redis-server killed (SIGKILL) or hung (SIGSTOP) in the middle of a
request changes no answer and slows no request by more than about its silence limit (remote_timeout_s: a hung
store sends nothing); the breaker logs once per outage; a restarted store is used again after the breaker's wait."""

from __future__ import annotations

import logging
import statistics
import time

import disk_worker  # noqa: E402
import pytest
from redis_server import NEEDS_REDIS, running_redis
from tiny_models import CHUNK, build_model, build_tokenizer

from engine import EngineConfig, KVBoost
from engine.generate import Result

pytestmark = NEEDS_REDIS


@pytest.fixture
def redis_server(tmp_path):
    yield from running_redis(tmp_path)


TIMEOUT_S = 0.05
RETRY_S = 0.5
# What a failing store may add to one request: the issue asks for ~100 ms; the silence limit here is 50 ms (a read
# of these tiny chunks saves less than that, so it gets no longer). The bound leaves room for a loaded CI machine;
# the measured numbers are printed (pytest -s).
SLOWER_BOUND_S = 0.3


def make_engine(url, folder) -> KVBoost:
    config = EngineConfig.of(chunk_size=CHUNK, cpu_cache_bytes=0, disk_cache_dir=str(folder),
                             remote_cache=url, remote_timeout_s=TIMEOUT_S, remote_retry_s=RETRY_S)
    return KVBoost(build_model("llama"), build_tokenizer(), config, name="tiny-llama")


def prompt(seed):
    return disk_worker.document(seed) + disk_worker.QUESTION


@pytest.fixture(scope="module")
def cold_answers():
    engine = KVBoost(build_model("llama"), build_tokenizer(), EngineConfig.of(reuse="off"), name="tiny-llama")
    return lambda seed: engine.generate(prompt(seed), max_new_tokens=disk_worker.NEW_TOKENS).token_ids


def timed(engine, seed, during=None):
    """(token ids, wall seconds) of one greedy request; `during` runs right after its first token, and its own
    time (pausing or killing the store and waiting for that) is not the request's."""
    t0 = time.perf_counter()
    events = engine.stream(prompt(seed), max_new_tokens=disk_worker.NEW_TOKENS)
    result = None
    for i, event in enumerate(events):
        if i == 0 and during is not None:
            started = time.perf_counter()
            during()
            t0 += time.perf_counter() - started
        if isinstance(event, Result):
            result = event
    return result.token_ids, time.perf_counter() - t0


def test_a_killed_or_hung_store_changes_no_answer_and_slows_no_request(redis_server, tmp_path, cold_answers,
                                                                       caplog, one_thread):
    """Each request with the shared tier is timed against the same prompt on an engine without it, right before
    (the same cold prefill, under the same machine load): the difference is what the tier costs."""
    caplog.set_level(logging.WARNING, logger="engine.kv.remote_tier")
    base = make_engine(None, tmp_path / "base")
    shared = make_engine(redis_server.url, tmp_path / "shared")
    timed(base, 99), timed(shared, 98)  # one-time costs of a first request
    extra: dict[str, list[float]] = {"healthy": [], "hung": [], "killed": []}
    baseline: list[float] = []

    def run(phase, seed, during=None):
        _, reference = timed(base, seed)
        ids, seconds = timed(shared, seed, during)
        assert ids == cold_answers(seed), f"{phase}: seed {seed}"
        baseline.append(reference)
        extra[phase].append(seconds - reference)

    for seed in (200, 201):
        run("healthy", seed)
    # hung in the middle of a request (after its first token, before its chunks are shared), then requests while
    # it stays hung, across more than one breaker wait (each wait ends in one trial call that times out)
    run("hung", 210, during=redis_server.pause)
    for seed in range(211, 216):
        run("hung", seed)
        time.sleep(RETRY_S / 2)
    redis_server.resume()
    assert shared.cache_stats().tiers.remote.errors >= 2
    time.sleep(RETRY_S)
    run("healthy", 216)  # the trial call succeeds: the outage is over
    assert shared.cache_stats().tiers.remote.state == "closed"
    # killed in the middle of a request, then requests while it is gone
    run("killed", 220, during=redis_server.kill)
    for seed in range(221, 226):
        run("killed", seed)
        time.sleep(RETRY_S / 2)
    print(f"\nrequest without the shared tier: median {statistics.median(baseline) * 1000:.0f} ms; with it, "
          "slower by at most " + ", ".join(
              f"{phase} {max(t) * 1000:+.0f} ms (median {statistics.median(t) * 1000:+.0f})"
              for phase, t in extra.items()))
    for phase, seconds in extra.items():
        assert max(seconds) < SLOWER_BOUND_S, (phase, seconds, baseline)
    # one warning per outage (hung, then gone), not one per call
    failures = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(failures) == 2, [r.getMessage() for r in caplog.records]
    stats = shared.cache_stats().tiers.remote
    assert stats.state != "closed" and stats.skipped > 0

    # restarted on the same port: after the breaker's wait the tier is used again, for reads and writes
    redis_server.start()
    time.sleep(RETRY_S + 0.05)
    run("healthy", 230)
    assert shared.store.remote.flush(10)
    stats = shared.cache_stats().tiers.remote
    assert stats.state == "closed" and stats.writes > 0
    fresh = make_engine(redis_server.url, tmp_path / "fresh")
    result = fresh.generate(prompt(230), max_new_tokens=disk_worker.NEW_TOKENS)
    assert result.stats.reused_by_tier == {"remote": disk_worker.DOC_TOKENS}
    assert result.token_ids == cold_answers(230)
    assert any("answers again" in r.getMessage() for r in caplog.records)
