"""The shared tier's timing follows the work: a read may take as long as the prefill it saves (the engine's measured
prefill rate times the tokens it restores, within a floor and a cap), the breaker opens on a store that fails or
stays silent, not on one that is merely slower than a constant, and what was read from the store is not written
back to it. On a loaded machine a second process reuses what the first shared."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from fake_resp import Drip, FakeResp, bulk
from processes import SUPPORT, child_env
from redis_server import NEEDS_REDIS, running_redis
from remote_worker import WIDE_CHUNK, WIDE_DOC_TOKENS
from tiny_models import CHUNK, build_model, build_tokenizer, random_ids

from engine import EngineConfig, KVBoost
from engine.keys import chain_key
from engine.kv.payload_file import encode_file
from engine.kv.remote_tier import DEFAULT_PREFILL_TOKENS_PER_S, RemoteEntry, RemoteTier
from engine.kv.resp import cpu_load, silence_limit
from engine.kv.tiers import encode_kv

ROOT = b"\0" * 16
TOKENS = tuple(range(3, 103))  # one entry of 100 tokens
ENTRY = RemoteEntry(chain_key(ROOT, TOKENS), ROOT, 0, TOKENS)


@pytest.fixture
def redis_server(tmp_path):
    yield from running_redis(tmp_path)


def payload_for(entry: RemoteEntry, namespace="ns-test") -> bytes:
    kv = tuple((torch.randn(1, 2, len(entry.tokens), 16), torch.randn(1, 2, len(entry.tokens), 16)) for _ in range(2))
    return encode_file(encode_kv(kv, "none", torch.device("cpu")), namespace, entry.key, entry.fields())


def slow_store(value: bytes, seconds: float) -> FakeResp:
    """A store that answers GET with `value`, sent in 40 pieces over `seconds`: slow, never silent."""
    reply = bulk(value)
    return FakeResp(lambda c: Drip(reply, every_s=seconds / 40, piece=-(-len(reply) // 40), max_s=30)
                    if c[0] == b"GET" else None)


def test_a_read_may_take_as_long_as_the_prefill_it_saves():
    value = payload_for(ENTRY)
    with slow_store(value, 0.6) as fake:
        tier = RemoteTier(fake.url, "ns-test", timeout_s=0.25)
        tier.observe_prefill(100, 2.0)  # this engine computes 50 tokens/s: the 100 tokens are worth 2 s
        assert tier.read_budget(100) == pytest.approx(2.0)
        found = tier.get_many([ENTRY])
        assert list(found) == [ENTRY.key]
        assert (tier.counters.hits, tier.counters.errors, tier.breaker.state) == (1, 0, "closed")
        tier.close()


def test_a_read_slower_than_what_it_saves_is_unread_not_an_outage():
    value = payload_for(ENTRY)
    with slow_store(value, 1.5) as fake:
        tier = RemoteTier(fake.url, "ns-test", timeout_s=0.25)
        tier.observe_prefill(1000, 0.5)  # 2000 tokens/s: the 100 tokens are worth 50 ms, the floor is 250 ms
        t0 = time.perf_counter()
        assert tier.get_many([ENTRY]) == {}
        assert 0.2 < time.perf_counter() - t0 < 0.6
        assert (tier.counters.unread, tier.counters.errors, tier.breaker.state) == (1, 0, "closed")
        tier.close()


def test_the_read_budget_has_a_default_a_floor_and_a_cap():
    tier = RemoteTier("redis://127.0.0.1:1/0", "ns-test", timeout_s=0.1, max_wait_s=3.0)
    assert tier.read_budget(300) == pytest.approx(300 / DEFAULT_PREFILL_TOKENS_PER_S)
    tier.observe_prefill(10_000, 1.0)
    assert tier.read_budget(10) == 0.1  # the floor
    tier.observe_prefill(10, 100.0)
    assert tier.read_budget(100_000) == 3.0  # the cap
    tier.close()


def test_an_engine_measures_its_prefill_rate(one_thread):
    config = EngineConfig.of(chunk_size=CHUNK, cpu_cache_bytes=0, disk_cache_bytes=0,
                             remote_cache="redis://127.0.0.1:1/0")
    engine = KVBoost(build_model("llama"), build_tokenizer(), config, name="tiny-llama")
    assert engine.cache_stats().tiers.remote.prefill_tokens_per_s is None
    t0 = time.perf_counter()
    result = engine.generate(random_ids(8 * CHUNK, seed=5), max_new_tokens=1)
    elapsed = time.perf_counter() - t0
    rate = engine.cache_stats().tiers.remote.prefill_tokens_per_s
    # the prefill is part of the request, so its rate is at least what the whole request managed
    assert rate is not None and rate >= result.stats.prompt_tokens / elapsed * 0.9


def run_worker(url, folder, mode, seed, env=None, silence_s=None):
    env = child_env(**(env or {}))
    args = [sys.executable, str(SUPPORT / "remote_worker.py"), url, str(folder), mode, str(WIDE_CHUNK), "none",
            str(seed), "--model", "wide", *([] if silence_s is None else ["--silence", str(silence_s)])]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def load_average() -> float:
    return os.getloadavg()[0]


def test_the_silence_limit_stretches_with_the_tasks_waiting_for_a_cpu():
    assert silence_limit(0.25, 0.0) == silence_limit(0.25, 1.0) == 0.25  # a CPU to spare: the limit as set
    assert silence_limit(0.25, 7.5) == pytest.approx(1.875)  # fifteen tasks on two cores


def test_the_machines_load_is_read_as_it_is_now():
    """Burners started a moment ago already count (the 1-minute average alone would lag them by a minute)."""
    cpus = len(os.sched_getaffinity(0))
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3 * cpus)]
    try:
        time.sleep(0.5)
        loads = []
        for _ in range(10):
            loads.append(cpu_load())
            time.sleep(0.05)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    assert max(loads) >= 2.5, loads


@NEEDS_REDIS
@pytest.mark.slow
def test_a_second_process_on_a_loaded_machine_reuses_what_the_first_shared(redis_server, tmp_path):
    """Tens of MB in the store, the machine's cores busy with six CPU burners a core (a load of ~15 on two): the
    second process's read takes longer than a fixed 50 ms could allow, but far less than the prefill it saves;
    and Redis, on the same cores, is off the CPU for longer than the default silence limit of an idle machine
    (250 ms; 274 ms was seen), which the limit stretched by the load (engine.kv.resp.silence_limit) waits for.
    Everything at its default."""
    first = run_worker(redis_server.url, tmp_path / "a", "ask", 7)
    assert first["stats"]["tiers"]["remote"]["written_bytes"] > 40 << 20
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
               for _ in range(6 * len(os.sched_getaffinity(0)))]
    try:
        time.sleep(1.0)
        second = run_worker(redis_server.url, tmp_path / "b", "ask", 7)
        remote = second["stats"]["tiers"]["remote"]
        print(f"\nload average while the second process ran: {load_average():.1f}; it read "
              f"{remote['read_bytes'] / 1e6:.0f} MB from the store in {remote['read_ms']:.0f} ms")
    finally:
        for burner in burners:
            burner.kill()
        for burner in burners:
            burner.wait()
    assert second["reused_by_tier"]["7"] == {"remote": WIDE_DOC_TOKENS}, remote
    assert second["answers"]["7"] == first["answers"]["7"]
    assert (remote["hits"], remote["errors"], remote["unread"], remote["state"]) == \
        (WIDE_DOC_TOKENS // WIDE_CHUNK, 0, 0, "closed")
    # what was read from the store is not written back to it
    assert remote["writes"] == 0 and remote["written_bytes"] == 0
