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
TIER = {"entries": int, "bytes": int, "budget_bytes": int, "kv_quant": str}
MEMORY_TIER = {**TIER, "budget_rule": str}  # where its budget came from: set, or the default's rule
DISK_TIER = {**TIER, "folder": str, "writes": int, "reads": int, "read_bytes": int, "read_ms": float,
             "bad": int, "errors": int, "evicted": int, "rejected": int}
REMOTE_TIER = {"url": str, "namespace": str, "kv_quant": str, "state": str, "breaker_trips": int,
               "last_error": (str, NONE), "queued": int, "prefill_tokens_per_s": (float, NONE), "max_value_bytes": int,
               "lookups": int, "hits": int, "misses": int, "bad": int, "unread": int, "read_bytes": int,
               "read_ms": float, "writes": int, "written_bytes": int, "dropped": int, "skipped": int, "refused": int,
               "errors": int}
HIT_KINDS = {"EXACT": int, "PREFIX": int, "APPROXIMATE": int, "QUANTIZED": int}
TIER_HITS = {"device": int, "host": int, "disk": int, "remote": int}
CHUNKING = {"mode": str, "size": int}
WEIGHTS = {"format": str, "kernel": str, "fallback_reason": (str, NONE), "head": str, "head_kernel": str,
           "embedding": str, "resident_bytes": int, "linear_bytes": int, "linear_float32_bytes": int, "head_bytes": int,
           "num_int4_linears": int, "gguf": (dict, NONE), "choice": ({"asked": str, "loaded": str, "why": str}, NONE),
           "attention": (str, NONE)}  # and "streaming" last, only where layers stream (tests/engine/test_stream_engine)
GGUF_TENSORS = {"tensors": int, "file_bytes": int, "bytes": int}


def cache_stats(tiers: dict, disk_error: bool = False) -> dict:
    return {"entries": int, "chunks": int, "tails": int, "bytes": int, "budget_bytes": int, "tokens": int,
            "hits": HIT_KINDS, "tier_hits": TIER_HITS, "misses": int, "stored": int, "evicted": int, "demoted": int,
            "promoted": int, "disk_misses": int, "rejected": int, "policy": str, "tiers": tiers, "reuse": str,
            **({"disk_error": str} if disk_error else {}), "chunking": CHUNKING}


def memory(tiers: list[str], *, disk_error: bool = False, remote: bool = False) -> dict:
    return {"device": str, "weights_bytes": int, "streamed_weights_bytes": int,
            "kv_bytes": dict.fromkeys(tiers, int), "kv_budget_bytes": dict.fromkeys(tiers, int),
            "kv_quant": dict.fromkeys(tiers, str),
            # the memory tiers' chunk counts and where their budgets came from (the disk's count needs a query)
            "kv_entries": dict.fromkeys([t for t in tiers if t != "disk"], int),
            "kv_budget_rules": dict.fromkeys([t for t in tiers if t != "disk"], str),
            **({"disk_error": str} if disk_error else {}),
            **({"remote": REMOTE_TIER} if remote else {})}  # device_used_bytes, device_total_bytes: CUDA only


def assert_shape(value, shape, where="report"):
    """`value` has exactly the keys of `shape`, in its order, each of its type (a bool is no int) or shape; a tuple
    of alternatives may hold a shape (a dict) beside types."""
    if isinstance(shape, tuple) and any(isinstance(kind, dict) for kind in shape):
        nested = next(kind for kind in shape if isinstance(kind, dict))
        if isinstance(value, dict):
            return assert_shape(value, nested, where)
        shape = tuple(kind for kind in shape if kind is not nested)
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
    assert info.weights.to_dict() == info.to_dict()["weights"] and info.cache_folder == info.to_dict()["cache_folder"]


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


def test_a_tiny_float_models_weights_report_is_a_dataclass_with_the_keys_the_dict_had():
    """A model built outside the loader: no GGUF mix, no choice; every byte count follows from the config (a tiny
    llama, its head untied from the table)."""
    from tiny_models import COMMON, VOCAB, build_model

    from engine import WeightsReport
    from engine.weights.weights_report import weights_report

    model = build_model("llama")
    report = weights_report(model)
    assert isinstance(report, WeightsReport)
    hidden, inner = COMMON["hidden_size"], COMMON["intermediate_size"]
    kv = COMMON["num_key_value_heads"] * hidden // COMMON["num_attention_heads"]  # k and v projections' rows
    linear = 4 * COMMON["num_hidden_layers"] * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inner)
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert report.to_dict() == {
        "format": "float32", "kernel": "dense", "fallback_reason": None, "head": "float32", "head_kernel": "dense",
        "embedding": "float32", "resident_bytes": held, "linear_bytes": linear, "linear_float32_bytes": linear,
        "head_bytes": 4 * VOCAB * hidden, "num_int4_linears": 0, "gguf": None, "choice": None, "attention": "sdpa"}
    assert list(report.to_dict()) == list(WEIGHTS)
    assert report.resident_bytes > linear + report.head_bytes  # the table and the norms too


def test_the_embedded_gguf_reports_its_weights_as_a_dataclass_and_info_as_the_same_json(smollm):
    """weights="auto" on the built-in 4-bit GGUF: the report says what auto chose and why, and per GGUF type what
    its tensors became; info()'s JSON (what /health and the app show) carries exactly the report's to_dict()."""
    from engine import WeightsReport
    from engine.reports import GgufTensors, WeightsChoice
    from engine.weights.weights_report import describe_weights, weights_report

    report = smollm.info().weights
    assert isinstance(report, WeightsReport) and report == weights_report(smollm.model)
    as_json = report.to_dict()
    assert_shape(as_json, WEIGHTS, "info().weights")
    assert report.choice == WeightsChoice(asked="auto", loaded=report.choice.loaded, why=report.choice.why)
    assert as_json["choice"] == {"asked": "auto", "loaded": report.choice.loaded, "why": report.choice.why}
    assert report.gguf and all(isinstance(entry, GgufTensors) for entry in report.gguf.values())
    for label, entry in as_json["gguf"].items():
        assert_shape(entry, GGUF_TENSORS, f"gguf[{label!r}]")
        assert entry == {"tensors": report.gguf[label].tensors, "file_bytes": report.gguf[label].file_bytes,
                         "bytes": report.gguf[label].bytes}
    assert sum(entry.tensors for entry in report.gguf.values()) == 61 + 210 + 1  # every tensor of the file
    assert smollm.info().to_dict()["weights"] == smollm.info().weights.to_dict() == as_json
    assert json.loads(json.dumps(as_json)) == as_json
    assert as_json["resident_bytes"] == smollm.memory().weights_bytes > 0
    assert describe_weights(report).startswith(f"weights {report.format}, ")
    assert f"(auto: {report.choice.why})" in describe_weights(report)
