"""info(), memory() and cache_stats() are dataclasses read by attribute, and their to_dict() is the JSON the API and
the front ends have always shown: the same keys in the same order, with the same types, an optional key only where
the engine has what it names. The shapes below are written out from what these reports held as dicts, so a report
that drops, renames, retypes or reorders a key fails here."""

from __future__ import annotations

import json

import pytest

NONE = type(None)

INFO = {"name": str, "model_type": str, "max_context": int, "device": str, "dtype": str, "reuse": str,
        "cache_folder": (str, NONE), "disk_error": (str, NONE), "weights": dict, "cuda_graphs_unavailable": (str, NONE),
        "layer_streaming_unavailable": (str, NONE), "awq_unavailable": (str, NONE)}
MEMORY_TIER = {"entries": int, "bytes": int, "budget_bytes": int, "kv_quant": str}
DISK_TIER = {**MEMORY_TIER, "folder": str, "writes": int, "reads": int, "read_bytes": int, "read_ms": float,
             "bad": int, "errors": int, "evicted": int, "rejected": int}
REMOTE_TIER = {"url": str, "namespace": str, "kv_quant": str, "state": str, "breaker_trips": int,
               "last_error": (str, NONE), "queued": int, "prefill_tokens_per_s": (float, NONE), "max_value_bytes": int,
               "lookups": int, "hits": int, "misses": int, "bad": int, "unread": int, "read_bytes": int,
               "read_ms": float, "writes": int, "written_bytes": int, "dropped": int, "skipped": int, "refused": int,
               "errors": int}
HIT_KINDS = {"EXACT": int, "PREFIX": int, "APPROXIMATE": int, "QUANTIZED": int}
TIER_HITS = {"device": int, "host": int, "disk": int, "remote": int}
CHUNKING = {"mode": str, "size": int}


def cache_stats(tiers: dict, disk_error: bool = False) -> dict:
    return {"entries": int, "chunks": int, "tails": int, "bytes": int, "budget_bytes": int, "tokens": int,
            "hits": HIT_KINDS, "tier_hits": TIER_HITS, "misses": int, "stored": int, "evicted": int, "demoted": int,
            "promoted": int, "disk_misses": int, "rejected": int, "policy": str, "tiers": tiers, "reuse": str,
            **({"disk_error": str} if disk_error else {}), "chunking": CHUNKING}


def memory(tiers: list[str], *, disk_error: bool = False, remote: bool = False) -> dict:
    return {"device": str, "weights_bytes": int, "streamed_weights_bytes": int,
            "kv_bytes": dict.fromkeys(tiers, int), "kv_budget_bytes": dict.fromkeys(tiers, int),
            "kv_quant": dict.fromkeys(tiers, str), **({"disk_error": str} if disk_error else {}),
            **({"remote": REMOTE_TIER} if remote else {})}  # device_used_bytes, device_total_bytes: CUDA only


def assert_shape(value, shape, where="report"):
    """`value` has exactly the keys of `shape`, in its order, each of its type (a bool is no int) or shape."""
    if isinstance(shape, dict):
        assert isinstance(value, dict), f"{where}: {value!r}"
        assert list(value) == list(shape), where
        for key, inner in shape.items():
            assert_shape(value[key], inner, f"{where}[{key!r}]")
    else:
        kinds = shape if isinstance(shape, tuple) else (shape,)
        assert type(value) in kinds, f"{where}: {value!r} is no {kinds}"


@pytest.fixture(scope="module")
def every_tier(smollm, tmp_path_factory):
    """The session's engine with a host tier, a disk tier and a shared tier nobody listens for (port 1), after a
    request."""
    engine = smollm.with_options(disk_cache_dir=tmp_path_factory.mktemp("kv"), disk_cache_bytes=None,
                                 cpu_cache_bytes=1 << 24, remote_cache="redis://127.0.0.1:1/0", remote_timeout_s=0.05)
    engine.generate("The quick brown fox jumps over the lazy dog. " * 12, max_new_tokens=2)
    return engine


def test_each_report_as_json_has_the_keys_and_types_it_had_as_a_dict(every_tier):
    info, held, stats = every_tier.info(), every_tier.memory(), every_tier.cache_stats()
    assert_shape(info.to_dict(), INFO, "info()")
    assert_shape(held.to_dict(), memory(["device", "host", "disk"], remote=True), "memory()")
    tiers = {"device": MEMORY_TIER, "host": MEMORY_TIER, "disk": DISK_TIER, "remote": REMOTE_TIER}
    assert_shape(stats.to_dict(), cache_stats(tiers), "cache_stats()")
    for report in (info, held, stats):  # JSON as it is, nothing to convert
        assert json.loads(json.dumps(report.to_dict())) == report.to_dict()


def test_reports_are_read_by_attribute_with_the_values_their_json_shows(every_tier):
    info, held, stats = every_tier.info(), every_tier.memory(), every_tier.cache_stats()
    as_json = stats.to_dict()
    assert stats.tiers.disk.writes == as_json["tiers"]["disk"]["writes"] > 0  # the request's chunks went to disk
    assert stats.tiers.remote.state == as_json["tiers"]["remote"]["state"] in ("closed", "open", "half-open")
    assert stats.hits == as_json["hits"] and stats.chunking.size == as_json["chunking"]["size"] == 128
    assert held.remote.url == held.to_dict()["remote"]["url"] == "redis://127.0.0.1:1/0"
    assert held.kv_bytes["device"] == stats.tiers.device.bytes and held.kv_quant["disk"] == stats.tiers.disk.kv_quant
    assert held.kv_budget_bytes["host"] == stats.tiers.host.budget_bytes == 1 << 24
    assert info.to_dict()["awq_unavailable"] == info.layer_streaming_unavailable  # the old key, for API clients
    assert info.weights == info.to_dict()["weights"] and info.cache_folder == info.to_dict()["cache_folder"]


def test_optional_keys_appear_only_where_the_engine_has_what_they_name(smollm, tmp_path):
    """Device tier alone, and a disk tier that could not be opened: no host, disk or shared tier keys, a
    disk_error key in memory() and cache_stats() (info() always has one)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # where the disk folder's parent should be: the disk tier cannot open
    engine = smollm.with_options(cpu_cache_bytes=0, disk_cache_dir=blocker / "kv", disk_cache_bytes=None)
    assert engine.disk_error is not None
    assert_shape(engine.info().to_dict(), INFO, "info()")
    assert engine.info().disk_error == engine.disk_error and engine.info().cache_folder is None
    assert_shape(engine.memory().to_dict(), memory(["device"], disk_error=True), "memory()")
    assert_shape(engine.cache_stats().to_dict(), cache_stats({"device": MEMORY_TIER}, disk_error=True),
                 "cache_stats()")
    tiers = engine.cache_stats().tiers
    assert (tiers.host, tiers.disk, tiers.remote) == (None, None, None)


def test_the_servers_health_still_carries_the_weights_report(every_tier):
    import httpx
    from server_helpers import RunningServer

    running = RunningServer(every_tier, model_id="reports")
    try:
        health = httpx.get(running.url + "/health", timeout=30).json()
    finally:
        running.stop()
    assert health["weights"] == json.loads(json.dumps(every_tier.info().to_dict()["weights"]))
    assert health["weights"]["resident_bytes"] == every_tier.memory().weights_bytes > 0
