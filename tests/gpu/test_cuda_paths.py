"""The CUDA paths, where a GPU exists (marked `gpu`: skipped without one, so never on CI): dtype choice, the device
budget from free VRAM, the pinned host tier and its copies, the VRAM meter, TTFT covering the device's work, the
pinned spill of long generations, and a restart from disk on the GPU equal to full prefill."""

from __future__ import annotations

import pytest
import torch
from tiny_models import CHUNK, build_model, build_tokenizer, random_ids  # noqa: E402

from engine import EngineConfig, KVBoost  # noqa: E402
from engine.kv.tiers import default_device_budget  # noqa: E402
from engine.ram_budget import machine_ram_budget  # noqa: E402
from engine.weights.loader import pick_dtype  # noqa: E402

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
PROMPT = random_ids(6 * CHUNK + 5, seed=80)


@pytest.fixture(scope="module")
def tiny_cuda():
    return build_model("llama").to(CUDA), build_tokenizer()


def engine_on(tiny_cuda, **config) -> KVBoost:
    fields = dict(chunk_size=CHUNK, disk_cache_bytes=0)
    fields.update(config)
    return KVBoost(*tiny_cuda, EngineConfig.of(**fields), name="tiny-llama")


def test_auto_dtype_is_bf16_where_supported_else_fp16():
    expected = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    assert pick_dtype("auto", CUDA) is expected


def test_the_device_budget_is_a_quarter_of_free_vram():
    free, _ = torch.cuda.mem_get_info(CUDA)
    budget, rule = default_device_budget(CUDA, machine_ram_budget())
    assert budget == pytest.approx(free / 4, rel=0.05) and rule.startswith("default: 25% of the ")


def test_the_host_tier_is_pinned_and_its_hits_equal_device_hits(tiny_cuda):
    # no device room: entries live in the pinned host tier and are copied to the GPU for each request
    engine = engine_on(tiny_cuda, cache_bytes=0, cpu_cache_bytes=1 << 30)
    first = engine.generate(PROMPT, max_new_tokens=8)
    store = engine.store
    assert store.host_tier.pin and len(store.host_tier) > 0
    for key in list(store.records):
        for part in store.host_tier._payloads[key].layers[0]:
            assert part.is_pinned()
    again = engine.generate(PROMPT, max_new_tokens=8)
    assert again.stats.reused_by_tier.get("host", 0) > 0
    assert again.token_ids == first.token_ids
    plain = engine_on(tiny_cuda, reuse="off").generate(PROMPT, max_new_tokens=8)
    assert again.token_ids == plain.token_ids


def test_the_memory_report_has_the_devices_totals(tiny_cuda):
    report = engine_on(tiny_cuda).memory()
    free, total = torch.cuda.mem_get_info(CUDA)
    assert report.device_total_bytes == total
    assert 0 < report.device_used_bytes <= total
    held = [*tiny_cuda[0].parameters(), *tiny_cuda[0].buffers()]  # the rotary tables are held too
    assert report.weights_bytes == sum(t.numel() * t.element_size() for t in held)


def test_ttft_covers_the_devices_work(tiny_cuda):
    """TTFT is taken after the device finished the prefill (a missing synchronize would make it ~0)."""
    engine = engine_on(tiny_cuda, reuse="off")
    long_prompt = random_ids(1500, seed=81)
    result = engine.generate(long_prompt, max_new_tokens=2)
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    with torch.inference_mode():
        tiny_cuda[0](input_ids=torch.tensor([long_prompt], device=CUDA), use_cache=False, logits_to_keep=1)
    end.record()
    torch.cuda.synchronize()
    assert result.stats.ttft_ms >= 0.5 * start.elapsed_time(end)


def test_a_long_generation_spilling_to_pinned_host_ram_matches_the_unbounded_run(tiny_cuda):
    bounded = engine_on(tiny_cuda, reuse="off", live_kv_bytes=48 * 2 * 2 * 2 * 16 * 4, live_page_tokens=16)
    unbounded = engine_on(tiny_cuda, reuse="off")
    a = bounded.generate(PROMPT, max_new_tokens=64)
    b = unbounded.generate(PROMPT, max_new_tokens=64)
    assert a.stats.spilled_tokens > 0
    assert a.token_ids == b.token_ids


def test_a_restart_from_the_disk_tier_on_the_gpu_equals_full_prefill(tiny_cuda, tmp_path):
    first = engine_on(tiny_cuda, disk_cache_dir=str(tmp_path), disk_cache_bytes=1 << 30)
    first.generate(PROMPT, max_new_tokens=8)
    restarted = engine_on(tiny_cuda, disk_cache_dir=str(tmp_path), disk_cache_bytes=1 << 30)
    result = restarted.generate(PROMPT, max_new_tokens=8)
    assert result.stats.reused_by_tier.get("disk", 0) >= 6 * CHUNK
    plain = engine_on(tiny_cuda, reuse="off").generate(PROMPT, max_new_tokens=8)
    assert result.token_ids == plain.token_ids
