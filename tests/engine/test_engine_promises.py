"""What the docs promise of the engine's options and stats (docs/engine.md, docs/promises.md), each checked where it
could break: timing stats present and consistent, the fingerprint following weights, dtype and RoPE config,
from_pretrained's eviction and gpu_cache_bytes options over a model folder, layer_streaming refused with the reason,
default tier budgets at the documented fractions."""

from __future__ import annotations

import os
import shutil
import threading
import time

import pytest
import torch
from tiny_models import CHUNK, build_model, build_tokenizer, random_ids

from engine import Cancelled, EngineConfig, KVBoost, UnsupportedModelError
from engine.kv.disk import default_disk_budget
from engine.kv.tiers import default_device_budget, default_host_budget
from engine.ram_budget import machine_ram_budget
from engine.weights.fingerprint import fingerprint

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(one_thread):
    return build_model("llama"), build_tokenizer()


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory, tiny):
    """The tiny Llama saved as a HuggingFace folder, so from_pretrained loads it like a user's model."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    model, tokenizer = tiny
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_timing_stats_are_present_and_consistent(tiny, tmp_path):
    model, tokenizer = tiny
    engine = KVBoost(model, tokenizer, EngineConfig.of(chunk_size=CHUNK, disk_cache_bytes=0))
    prompt = random_ids(5 * CHUNK + 3, seed=1)
    t0 = time.perf_counter()
    result = engine.generate(prompt, max_new_tokens=NEW_TOKENS)
    wall_ms = (time.perf_counter() - t0) * 1000
    s = result.stats
    assert s.generated_tokens == NEW_TOKENS == len(result.token_ids)
    assert 0 < s.ttft_ms < s.total_ms <= wall_ms + 1
    assert 0 < s.store_ms < s.total_ms  # five chunks and a tail were stored inside the call
    decode_s = (s.total_ms - s.ttft_ms) / 1000
    # tokens after the first over the time after the first token (within what the stats themselves measure)
    assert s.decode_tokens_per_s == pytest.approx((NEW_TOKENS - 1) / decode_s, rel=0.25)
    assert s.prompt_tokens == len(prompt) == s.reused_tokens + s.recomputed_tokens
    assert 0 < s.prefill_ms < s.ttft_ms  # the computed tokens' forwards alone, inside the time to first token
    again = engine.generate(prompt, max_new_tokens=NEW_TOKENS).stats  # all but the last token reused
    assert again.recomputed_tokens < CHUNK and 0 < again.prefill_ms < s.prefill_ms


def test_the_fingerprint_follows_weights_dtype_and_rope_config(tiny):
    model, _ = tiny
    base = fingerprint(model)
    assert fingerprint(build_model("llama")) == base  # the same weights in another object: the same identity
    changed = build_model("llama")
    with torch.no_grad():
        changed.model.layers[1].mlp.down_proj.weight.mul_(1.001)  # a fine-tune's worth of change in one tensor
    assert fingerprint(changed) != base
    assert fingerprint(build_model("llama").to(torch.bfloat16)) != base
    rope = build_model("llama")
    rope.config.rope_parameters = dict(rope.config.rope_parameters, rope_theta=20000.0)  # other positions
    assert fingerprint(rope) != base



def test_the_fingerprint_tells_attention_implementations_apart(tiny):
    """sdpa and eager attention round differently: their KV must never meet in a shared disk folder or store."""
    model, _ = tiny
    eager = build_model("llama")
    eager.config._attn_implementation = "eager"
    assert fingerprint(eager) != fingerprint(model)


def test_from_pretrained_takes_lru_eviction_and_the_gpu_cache_bytes_alias(model_folder, tmp_path):
    engine = KVBoost.from_pretrained(model_folder, device="cpu", eviction="lru", gpu_cache_bytes=123_456,
                                     disk_cache_bytes=0, cpu_cache_bytes=0)
    stats = engine.cache_stats()
    assert stats.policy == "lru"
    assert stats.budget_bytes == 123_456 == stats.tiers.device.budget_bytes
    assert engine.generate(random_ids(20, seed=2), max_new_tokens=2).token_ids
    same = KVBoost.from_pretrained(model_folder, device="cpu", cache_bytes=123_456, gpu_cache_bytes=123_456,
                                   disk_cache_bytes=0)
    assert same.cache_stats().budget_bytes == 123_456
    with pytest.raises(ValueError, match="same option"):
        KVBoost.from_pretrained(model_folder, device="cpu", cache_bytes=1, gpu_cache_bytes=2)
    with pytest.raises(ValueError, match="eviction"):
        KVBoost.from_pretrained(model_folder, device="cpu", eviction="fifo")


def test_layer_streaming_is_refused_with_the_reason_where_it_cannot_run(model_folder):
    t0 = time.perf_counter()  # a float checkpoint under weights="auto" stays float: nothing int4 to stream
    with pytest.raises(UnsupportedModelError, match="layer streaming: needs int4 weights"):
        KVBoost.from_pretrained(model_folder, device="cpu", layer_streaming=True)
    assert time.perf_counter() - t0 < 10  # refused from the config, before the weights load


class SetAfter(threading.Event):
    """A real Event that reads as set from its (n + 1)-th is_set() on, as if a user pressed Cancel right after the
    load checked it n times; `calls` counts the checks."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n
        self.calls = 0

    def is_set(self) -> bool:
        self.calls += 1
        return self.calls > self.n or super().is_set()


def test_a_load_cancelled_before_it_starts_raises_cancelled(model_folder, tmp_path):
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(Cancelled, match="model load cancelled"):
        KVBoost.from_pretrained(model_folder, device="cpu", disk_cache_dir=tmp_path / "kv", cancel=cancel)
    assert not (tmp_path / "kv").exists()  # no engine was built


@pytest.mark.parametrize("checks_before_cancel", [0, 1, 2])
def test_each_stage_of_a_load_checks_cancel(model_folder, tmp_path, checks_before_cancel):
    """Set after the source is resolved, after the config, after the weights: each stage stops the load there."""
    cancel = SetAfter(checks_before_cancel)
    with pytest.raises(Cancelled):
        KVBoost.from_pretrained(model_folder, device="cpu", disk_cache_dir=tmp_path / "kv", cancel=cancel)
    assert cancel.calls == checks_before_cancel + 1
    assert not (tmp_path / "kv").exists()  # the engine (and its disk tier) comes after the last check


def test_a_load_never_cancelled_checks_at_every_stage_and_step_and_loads(model_folder, tmp_path):
    """Three stages (source found, config read, weights loaded) and every progress step of the load between
    them; a load that was never cancelled completes."""
    cancel = SetAfter(10_000)
    steps = []
    engine = KVBoost.from_pretrained(model_folder, device="cpu", disk_cache_dir=tmp_path / "kv", cancel=cancel,
                                     progress=lambda *step: steps.append(step))
    assert steps and cancel.calls == 3 + len(steps)
    assert (tmp_path / "kv").is_dir()
    assert engine.generate(random_ids(20, seed=2), max_new_tokens=2).token_ids


def _mem_total_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal")


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="reads RAM size from /proc/meminfo")
def test_default_budgets_follow_the_documented_fractions(tmp_path):
    ram = _mem_total_bytes()
    cpu = torch.device("cpu")
    # on a CPU-only machine both memory tiers are RAM: together at most a tenth of it (or less: default_ram_budget),
    # the device tier two thirds of that, the overflow tier the rest
    budget = machine_ram_budget()
    assert budget.bytes <= min(ram // 10, 4 << 30)
    assert default_device_budget(cpu, budget)[0] + default_host_budget(cpu, budget)[0] == budget.bytes
    assert default_device_budget(cpu, budget)[0] == budget.bytes * 2 // 3
    # disk: a fifth of the free space where the folder will be, at most 20 GiB
    free = shutil.disk_usage(tmp_path).free
    assert default_disk_budget(tmp_path / "not" / "there" / "yet") == pytest.approx(min(free / 5, 20 << 30),
                                                                                    rel=0.01)


def test_info_describes_the_loaded_model_for_front_ends(model_folder, tmp_path):
    engine = KVBoost.from_pretrained(model_folder, device="cpu", disk_cache_dir=tmp_path / "kv", quiet=True)
    info = engine.info()
    assert info.model_type == "llama" and info.max_context == 2048
    assert info.device == "cpu" and info.dtype == "float32" and info.reuse == "chunk"
    assert info.cache_folder == (tmp_path / "kv").as_posix() and info.disk_error is None
    assert "needs int4 weights" in info.layer_streaming_unavailable  # a float model: nothing to stream
    assert engine.decode(engine.encode("w5 w6 w7")) == "w5 w6 w7"
    off = KVBoost.from_pretrained(model_folder, device="cpu", disk_cache_bytes=0)
    assert off.info().cache_folder is None


def test_with_options_keeps_every_option_it_is_not_told_to_change():
    from dataclasses import replace

    config = EngineConfig.of(reuse="prefix", chunk_size=CHUNK, cpu_cache_bytes=1 << 20,
                             disk_cache_bytes=0, disk_busy_timeout_s=5.0, eviction="lru", live_page_tokens=64,
                             speculative=None, num_draft=2, remote_timeout_s=0.5, remote_max_wait_s=2.0,
                             remote_retry_s=1.0, remote_max_value_bytes=1 << 20, prefill_piece_tokens=64,
                             cuda_graphs=False)
    engine = KVBoost(build_model("llama"), build_tokenizer(), config, name="tiny")
    assert engine.with_options().config == config
    assert engine.with_options(num_draft=3).config == replace(config, decode=replace(config.decode, num_draft=3))
