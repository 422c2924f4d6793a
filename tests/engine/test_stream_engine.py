"""Layer streaming through the engine facade: from_pretrained(layer_streaming=True) on a tiny AWQ checkpoint
answers with the resident engine's tokens and logits, reports its plan, bandwidth and prediction, counts tokens
per weight pass, holds fewer bytes on the device; refusals (float weights, a budget below the minimum) come
before or instead of a load, with the reason."""

from __future__ import annotations

import threading

import pytest
import torch
from awq_checkpoints import write_awq_checkpoint
from tiny_models import ARCHS, COMMON, random_ids
from transformers import LlamaConfig

from engine import KVBoost, UnsupportedModelError
from engine.weights.stream_setup import probe_bandwidth

PROMPT = random_ids(54, seed=3)  # token ids (the tiny tokenizer knows few words)


@pytest.fixture(scope="module")
def awq_folder(tmp_path_factory):
    """A six-layer tiny llama as an AWQ checkpoint: more layers than slots, so the smallest plan streams."""
    folder = tmp_path_factory.mktemp("awq-stream-engine") / "llama6"
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(ARCHS, "llama6", (lambda: LlamaConfig(**{**COMMON, "num_hidden_layers": 6}), "sdpa"))
        write_awq_checkpoint(folder, "llama6", 32)
    return folder


def load(folder, tmp_path, **options) -> KVBoost:
    return KVBoost.from_pretrained(str(folder), device="cpu", disk_cache_bytes=0, reuse="off", **options)


def smallest_budget(folder, tmp_path) -> int:
    """The minimum of the plan for this model (read from a plan made with a budget that holds everything)."""
    probe = load(folder, tmp_path, layer_streaming=True, weight_budget_bytes=1 << 40)
    return probe.info().weights.streaming.min_budget_bytes


def test_a_streamed_engine_answers_as_the_resident_one_and_reports_its_plan(awq_folder, tmp_path, one_thread):
    resident = load(awq_folder, tmp_path)
    minimum = smallest_budget(awq_folder, tmp_path)
    streamed = load(awq_folder, tmp_path, layer_streaming=True, weight_budget_bytes=minimum)
    want = resident.generate(PROMPT, max_new_tokens=8, return_logits=True)
    got = streamed.generate(PROMPT, max_new_tokens=8, return_logits=True)
    assert got.token_ids == want.token_ids
    assert torch.equal(got.first_logits, want.first_logits) and want.first_logits.abs().max() > 0
    assert len(set(want.token_ids)) > 1

    report = streamed.info().weights.streaming
    num_layers = resident.model.config.num_hidden_layers
    assert report.streamed_layers and sorted(report.resident_layers + report.streamed_layers) == \
        list(range(num_layers))
    assert report.min_budget_bytes == minimum == report.budget_bytes
    assert report.bandwidth_bytes_per_s > 0
    assert report.predicted_decode_tokens_per_s == pytest.approx(
        report.bandwidth_bytes_per_s / report.streamed_bytes)
    as_json = streamed.info().to_dict()["weights"]  # the API's JSON: "streaming" last, and only where layers stream
    assert list(as_json)[-1] == "streaming" and "streaming" not in resident.info().to_dict()["weights"]
    assert list(as_json["streaming"]) == ["resident_layers", "streamed_layers", "resident_bytes", "streamed_bytes",
                                          "min_budget_bytes", "budget_bytes", "num_slots", "slot_bytes",
                                          "bandwidth_bytes_per_s", "predicted_decode_tokens_per_s"]
    assert as_json["resident_bytes"] == as_json["streaming"]["resident_bytes"] == report.resident_bytes
    # one weight pass for the prompt, one per decode forward (which speculative decoding makes fewer than tokens)
    assert got.stats.weight_passes == 1 + got.stats.decode_forwards
    prompt_tokens = got.stats.prompt_tokens
    fed = got.stats.decode_forwards + got.stats.drafted_tokens  # each decode forward: a token and its drafts
    assert got.stats.tokens_per_weight_pass == pytest.approx((prompt_tokens + fed) / got.stats.weight_passes)
    assert want.stats.weight_passes == 0

    held, everything = streamed.memory(), resident.memory()
    assert held.streamed_weights_bytes == report.streamed_bytes > 0
    assert held.weights_bytes < everything.weights_bytes
    assert everything.streamed_weights_bytes == 0


def test_a_budget_that_holds_everything_streams_nothing_and_answers_the_same(awq_folder, tmp_path, one_thread):
    engine = load(awq_folder, tmp_path, layer_streaming=True, weight_budget_bytes=1 << 40)
    report = engine.info().weights.streaming
    assert report.streamed_layers == [] and report.predicted_decode_tokens_per_s is None
    assert engine.generate(PROMPT, max_new_tokens=4).token_ids == \
        load(awq_folder, tmp_path).generate(PROMPT, max_new_tokens=4).token_ids


def test_a_budget_below_the_minimum_is_an_error_naming_it(awq_folder, tmp_path, one_thread):
    minimum = smallest_budget(awq_folder, tmp_path)
    with pytest.raises(ValueError, match=f"minimum of {minimum} bytes"):
        load(awq_folder, tmp_path, layer_streaming=True, weight_budget_bytes=minimum - 1)


def test_streaming_float_weights_is_refused_before_loading(tmp_path):
    # A folder with only a config: the refusal must come from the config, before any weight is read.
    write_awq_checkpoint(tmp_path / "m", "llama", 32)
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(UnsupportedModelError, match="needs int4 weights"):
        load(tmp_path / "m", tmp_path, layer_streaming=True, weights="float")


def test_the_info_of_an_int4_engine_says_streaming_can_run_and_of_a_float_one_why_not(awq_folder, tmp_path):
    assert load(awq_folder, tmp_path).info().layer_streaming_unavailable is None
    assert "needs int4 weights" in load(awq_folder, tmp_path, weights="float").info().layer_streaming_unavailable


def test_the_bandwidth_probe_measures_a_real_copy():
    assert probe_bandwidth(torch.device("cpu"), 8 << 20) > 1e7  # any machine copies 10 MB/s


def test_a_model_staged_on_the_host_computes_as_one_loaded_on_its_device(awq_folder, one_thread):
    """What a CUDA load for streaming does (load on the host in the reference layout, lay each layer out for the
    device's kernel and keep it on the host), with the CPU and its kernel standing in for the GPU and tinygemm."""
    from engine.weights.int4 import Int4Linear, kernel_unavailable
    from engine.weights.loader import load_model, resolve_source
    from engine.weights.stream_setup import stage_for_streaming
    from engine.weights.streaming import decoder_layers

    if kernel_unavailable("cpu_int4pack", "cpu") is not None:
        pytest.skip("no CPU int4 kernel")
    cpu, src = torch.device("cpu"), resolve_source(str(awq_folder))
    direct, _ = load_model(src, cpu, torch.float32, weights="int4", kernel="cpu_int4pack", head="float")
    staged, _ = load_model(src, cpu, torch.float32, weights="int4", kernel="reference", head="float")
    stage_for_streaming(staged, cpu, "cpu_int4pack")
    kernels = {m.kernel for layer in decoder_layers(staged) for m in layer.modules() if isinstance(m, Int4Linear)}
    assert kernels == {"cpu_int4pack"}
    assert staged.get_output_embeddings().weight is not None
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        assert torch.equal(staged(ids).logits, direct(ids).logits)


def test_batched_requests_share_each_weight_pass_of_a_streamed_model(awq_folder, tmp_path, one_thread):
    """One forward per step for the whole batch: with layer streaming, each copy of the streamed layers serves
    every request in it (and their drafted tokens)."""
    from engine import EngineWorker, Result

    budget = smallest_budget(awq_folder, tmp_path)
    streamed = load(awq_folder, tmp_path, layer_streaming=True, weight_budget_bytes=budget)
    prompts = [PROMPT, random_ids(40, seed=4), random_ids(33, seed=5)]
    alone = [streamed.generate(p, max_new_tokens=12) for p in prompts]
    worker = EngineWorker(name="test-stream-batch")
    gate = threading.Event()
    worker.submit(lambda cancel: gate.wait(30), source="gate")
    jobs = [worker.submit(lambda c, p=p: streamed.stream(p, cancel=c, max_new_tokens=12)) for p in prompts]
    passes_before, tokens_before = streamed.streaming.counters()
    gate.set()
    together = [[e for e in job if isinstance(e, Result)][0] for job in jobs]
    passes, tokens = (now - before
                      for now, before in zip(streamed.streaming.counters(), (passes_before, tokens_before)))
    assert worker.stop(5)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    forwards_alone = sum(r.stats.decode_forwards + 1 for r in alone)  # + 1: each prompt's prefill pass
    assert passes < forwards_alone * 0.6  # batched: most passes served all three
    assert tokens / passes > 1.5


def test_the_old_option_name_still_streams_with_a_deprecation_warning(awq_folder, tmp_path):
    """`awq_streaming` (the name before streaming took any int4 or GGUF-block layers) works for one release."""
    with pytest.warns(DeprecationWarning, match="layer_streaming"):
        engine = load(awq_folder, tmp_path, awq_streaming=True, weight_budget_bytes=1 << 40)
    assert engine.streaming is not None
    with pytest.raises(ValueError, match="disagree"), pytest.warns(DeprecationWarning):
        load(awq_folder, tmp_path, layer_streaming=True, awq_streaming=False)
    info = engine.info().to_dict()
    assert info["awq_unavailable"] == info["layer_streaming_unavailable"] is None  # the old key, for API clients
    from engine import awq_streaming_unavailable

    with pytest.warns(DeprecationWarning):
        assert awq_streaming_unavailable(engine.model.config, torch.device("cpu"), "float") is not None
