"""The shared KV tier over a real redis-server on 127.0.0.1: two processes with their own disk folders share what
one computed, entries of another model or setting are never served, values that fail a check are misses and are
deleted, entries the store evicts under its memory budget are misses, and a full write queue drops, not blocks."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import disk_worker  # the documents and question the worker processes use
import pytest
import torch
from processes import SUPPORT, child_env
from redis_server import NEEDS_REDIS, running_redis
from tiny_models import CHUNK, build_model, build_tokenizer

from engine import EngineConfig, KVBoost
from engine.config import KVQuantConfig
from engine.keys import chain_key
from engine.kv.records import ChunkRecord
from engine.kv.remote_tier import RemoteEntry, RemoteTier
from engine.kv.tiers import encode_kv

pytestmark = NEEDS_REDIS


@pytest.fixture
def redis_server(tmp_path):
    yield from running_redis(tmp_path)

DOC_CHUNKS = disk_worker.DOC_TOKENS // CHUNK


def run_worker(url, folder, mode, *seeds, chunk=CHUNK, quant="none"):
    env = child_env()
    args = [sys.executable, str(SUPPORT / "remote_worker.py"), url, str(folder), mode, str(chunk), quant,
            *map(str, seeds)]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cold_answers():
    engine = KVBoost(build_model("llama"), build_tokenizer(), EngineConfig.of(reuse="off"), name="tiny-llama")
    return lambda seed: engine.generate(disk_worker.document(seed) + disk_worker.QUESTION,
                                        max_new_tokens=disk_worker.NEW_TOKENS).token_ids


def make_engine(url, folder, model=None, chunk=CHUNK, quant="none", **options) -> KVBoost:
    config = EngineConfig.of(chunk_size=chunk, cpu_cache_bytes=0, disk_cache_dir=str(folder),
                             kv_quant=KVQuantConfig(disk=quant), remote_cache=url, **options)
    return KVBoost(model or build_model("llama"), build_tokenizer(), config, name="tiny-llama")


def ask(engine, seed):
    return engine.generate(disk_worker.document(seed) + disk_worker.QUESTION, max_new_tokens=disk_worker.NEW_TOKENS)


def stored_keys(server) -> list[bytes]:
    return sorted(k for k in server.client().keys("kvboost:*") if k != b"kvboost:namespaces")


def test_a_second_process_answers_from_what_the_first_shared(redis_server, tmp_path, cold_answers):
    first = run_worker(redis_server.url, tmp_path / "a", "warm", 1, 2)
    assert first["flushed"] and first["stats"]["tiers"]["remote"]["writes"] == 2 * DOC_CHUNKS
    second = run_worker(redis_server.url, tmp_path / "b", "ask", 1, 2)
    for seed in ("1", "2"):
        # every chunk of the document came from the store (the second process's own folder started empty)
        assert second["reused_by_tier"][seed] == {"remote": disk_worker.DOC_TOKENS}
        assert second["answers"][seed] == cold_answers(int(seed))
    remote = second["stats"]["tiers"]["remote"]
    assert remote["hits"] == 2 * DOC_CHUNKS and remote["bad"] == 0 and remote["errors"] == 0
    assert remote["writes"] == 0  # what came from the store is not written back to it
    assert remote["read_bytes"] == first["stats"]["tiers"]["remote"]["written_bytes"]
    assert second["stats"]["tier_hits"]["remote"] == 2 * DOC_CHUNKS
    # what came from the store is now on the second process's disk too: a third read needs no store at all
    assert second["stats"]["tiers"]["disk"]["entries"] >= 2 * DOC_CHUNKS


def test_entries_of_another_setting_or_model_are_never_served(redis_server, tmp_path, cold_answers):
    run_worker(redis_server.url, tmp_path / "a", "warm", 3)
    for i, (chunk, quant) in enumerate([(2 * CHUNK, "none"), (CHUNK, "int8")]):
        other = run_worker(redis_server.url, tmp_path / f"o{i}", "ask", 3, chunk=chunk, quant=quant)
        assert other["reused_by_tier"]["3"] == {}
        assert other["stats"]["tiers"]["remote"]["hits"] == 0
        assert other["answers"]["3"] == cold_answers(3)
    # other weights (one value changed): another fingerprint, another namespace
    model = build_model("llama")
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight[0, 0] += 0.5
    other = ask(make_engine(redis_server.url, tmp_path / "w", model=model), 3)
    assert other.stats.reused_by_tier == {}
    namespaces = {k.split(b":")[1] for k in stored_keys(redis_server)}
    assert len(namespaces) == 4  # each setting wrote under its own namespace
    assert len(redis_server.client().hgetall("kvboost:namespaces")) == 4


def test_values_that_fail_a_check_are_misses_and_deleted(redis_server, tmp_path, cold_answers):
    run_worker(redis_server.url, tmp_path / "a", "warm", 4)
    client = redis_server.client()
    keys = stored_keys(redis_server)
    good = {k: client.get(k) for k in keys}
    assert len(keys) == DOC_CHUNKS
    flipped = bytearray(good[keys[0]])
    flipped[-5] ^= 0x40  # one bit of the data
    client.set(keys[0], bytes(flipped))
    client.set(keys[1], good[keys[1]][:-64])  # truncated
    client.set(keys[2], good[keys[3]])  # another chunk's (valid) value under this key
    client.set(keys[4], b"not a payload at all")
    engine = make_engine(redis_server.url, tmp_path / "b")
    result = ask(engine, 4)
    assert result.token_ids == cold_answers(4)
    remote = engine.cache_stats().tiers.remote
    assert remote.bad == 4 and remote.hits == DOC_CHUNKS - 4
    assert result.stats.reused_by_tier.get("remote", 0) < disk_worker.DOC_TOKENS
    assert engine.store.remote.flush()
    # the bad values were deleted and the chunks computed again were shared afresh: the good bytes are back
    assert {k: client.get(k) for k in keys} == good


def test_a_bad_value_is_deleted_from_the_store(redis_server):
    tier = RemoteTier(redis_server.url, "ns-test")
    entry = RemoteEntry(chain_key(b"\0" * 16, [5, 6, 7]), b"\0" * 16, 0, (5, 6, 7))
    redis_server.client().set(tier.key(entry.key), b"garbage")
    assert tier.get_many([entry]) == {}
    assert tier.flush()
    assert redis_server.client().exists(tier.key(entry.key)) == 0
    assert tier.counters.bad == 1
    tier.close()


def test_entries_the_store_evicts_are_misses_and_answers_stay_the_same(redis_server, tmp_path, cold_answers):
    client = redis_server.client()
    used = client.info("memory")["used_memory"]
    value_bytes = 9_500  # one tiny-model chunk as stored (about 9 KB)
    client.config_set("maxmemory-policy", "allkeys-lru")
    # Room for fewer than the 50 chunks below: the store's own overhead while they arrive (client buffers, key
    # bookkeeping) takes ~120 KB of it, measured; with 25 chunks' room an unlucky moment evicted them all.
    client.config_set("maxmemory", used + 35 * value_bytes)
    seeds = [10, 11, 12, 13, 14]
    run_worker(redis_server.url, tmp_path / "a", "warm", *seeds)
    assert client.info("stats")["evicted_keys"] > 0
    kept = len(stored_keys(redis_server))
    assert 0 < kept < 5 * DOC_CHUNKS
    # newest first: in warm order, each document's misses (computed and shared again) would evict the next one's
    # chunks, LRU's sequential-scan pattern
    second = run_worker(redis_server.url, tmp_path / "b", "ask", *seeds[::-1])
    remote = second["stats"]["tiers"]["remote"]
    assert remote["misses"] > 0 and remote["hits"] > 0 and remote["bad"] == 0
    for seed in seeds:
        assert second["answers"][str(seed)] == cold_answers(seed)


def test_a_full_write_queue_drops_writes_without_waiting(redis_server):
    """The store hung: the writer thread waits on its first write, two more fit the queue, the rest are dropped,
    and queueing never waits for the store."""
    tier = RemoteTier(redis_server.url, "ns-test", timeout_s=2.0, queue_items=2)
    kv = tuple((torch.randn(1, 2, CHUNK, 16), torch.randn(1, 2, CHUNK, 16)) for _ in range(2))
    stored = encode_kv(kv, "none", torch.device("cpu"))
    redis_server.pause()
    try:
        queued, slowest = [], 0.0
        for i in range(10):
            tokens = tuple(range(i, i + CHUNK))
            record = ChunkRecord(chain_key(b"\0" * 16, tokens), b"\0" * 16, None, "chunk", 0, tokens, stored.nbytes)
            t0 = time.perf_counter()
            queued.append(tier.put(record, stored))
            slowest = max(slowest, time.perf_counter() - t0)
            time.sleep(0.01)  # the writer takes the first one off the queue
    finally:
        redis_server.resume()
    assert queued[:3] == [True, True, True] and not any(queued[3:])
    assert tier.counters.dropped == 7
    # No put waited for the hung store: a wait would last the tier's 2 s timeout. (Timing the puts alone, not
    # the loop's sleeps, which a loaded machine stretches.)
    assert slowest < 0.5, slowest
    assert tier.flush(10)
    assert tier.counters.writes == 3 and len(stored_keys(redis_server)) == 3
    tier.close()


def test_a_full_store_that_refuses_writes_still_serves_reads(redis_server):
    """maxmemory reached under `noeviction`: a write is refused with OOM. That says nothing about reads, so
    it is counted as `refused` and the breaker stays closed: what the store holds keeps being served."""
    tier = RemoteTier(redis_server.url, "ns-test")
    kv = tuple((torch.randn(1, 2, CHUNK, 16), torch.randn(1, 2, CHUNK, 16)) for _ in range(2))
    stored = encode_kv(kv, "none", torch.device("cpu"))

    def record(first):
        tokens = tuple(range(first, first + CHUNK))
        return ChunkRecord(chain_key(b"\0" * 16, tokens), b"\0" * 16, None, "chunk", 0, tokens, stored.nbytes)

    kept = record(0)
    assert tier.put(kept, stored) and tier.flush()
    client = redis_server.client()
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", client.info("memory")["used_memory"])  # full
    assert tier.put(record(1), stored) and tier.flush()
    assert tier.counters.refused == 1 and tier.counters.writes == 1
    assert tier.breaker.state == "closed"
    entry = RemoteEntry(kept.key, kept.parent, kept.start, tuple(kept.tokens))
    assert list(tier.get_many([entry])) == [kept.key]
    tier.close()


def test_kvboost_cache_stats_shows_the_remote_tier(redis_server, tmp_path, capsys):
    from cli.kvboost import main

    run_worker(redis_server.url, tmp_path / "a", "warm", 5)
    assert main(["cache", "stats", "--dir", str(tmp_path / "a"), "--remote-cache", redis_server.url]) == 0
    out = capsys.readouterr().out
    assert f"{redis_server.url}: {DOC_CHUNKS} entries" in out
    assert "tiny-llama" in out and "chunk_size=16" in out
    assert main(["cache", "stats", "--json", "--remote-cache", redis_server.url]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["remote"]["entries"] == DOC_CHUNKS and report["remote"]["namespaces"][0]["entries"] == DOC_CHUNKS


def test_a_password_in_the_url_is_used_and_a_wrong_one_is_a_counted_error(tmp_path):
    from redis_server import BINARY, RedisServer

    if BINARY is None:
        pytest.skip("redis-server is not installed")
    server = RedisServer(tmp_path, password="s3cret").start()
    try:
        warm = make_engine(server.url, tmp_path / "a")
        warm.warm(disk_worker.document(30))
        assert warm.store.remote.flush() and warm.cache_stats().tiers.remote.writes == DOC_CHUNKS
        assert ask(make_engine(server.url, tmp_path / "b"), 30).stats.reused_by_tier == \
            {"remote": disk_worker.DOC_TOKENS}
        wrong = make_engine(server.url.replace("s3cret", "guess"), tmp_path / "c")
        result = ask(wrong, 30)
        assert result.stats.reused_by_tier == {}
        remote = wrong.cache_stats().tiers.remote
        assert remote.errors == 1 and remote.state == "open" and "guess" not in str(remote.to_dict())
    finally:
        server.stop()
