"""The weight memory shown before loading (engine.weights.weight_sizes) is what loading then holds, per format."""

from __future__ import annotations

import pytest
import torch
from awq_checkpoints import write_awq_checkpoint
from tiny_models import build_model, build_tokenizer

from engine.weights import gguf_blocks, weight_sizes
from engine.weights.gguf_loader import auto_block_types
from engine.weights.head import int8_kernel_unavailable
from engine.weights.loader import load_model, resolve_source
from engine.weights.weights_report import weights_report

CPU = torch.device("cpu")


def held_bytes(folder, **options) -> int:
    model, _ = load_model(resolve_source(str(folder)), CPU, torch.float32, **options)
    return weights_report(model).resident_bytes


def close(estimate: int, held: int) -> bool:
    # Buffers that are not weights (the rotary inv_freq: a few hundred bytes) are held but not estimated.
    return abs(estimate - held) <= 0.01 * held


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_the_estimate_of_a_float_folder_is_what_float_and_int4_loads_hold(tmp_path, arch, one_thread):
    build_model(arch).save_pretrained(tmp_path)
    build_tokenizer().save_pretrained(tmp_path)
    sizes = weight_sizes.estimate(str(tmp_path), device="cpu", group_size=32)
    assert not sizes["awq"] and sizes["dtype"] == "float32"
    assert close(sizes["float"], held_bytes(tmp_path)), (sizes, held_bytes(tmp_path))
    assert close(sizes["int4"], held_bytes(tmp_path, weights="int4", group_size=32))
    assert sizes["int4"] < sizes["float"]


def test_an_awq_checkpoint_is_estimated_at_its_own_group_size(tmp_path, one_thread):
    write_awq_checkpoint(tmp_path, "qwen2", 32)
    sizes = weight_sizes.estimate(str(tmp_path), device="cpu", group_size=128)
    assert sizes["awq"] and sizes["group_size"] == 32
    assert close(sizes["int4"], held_bytes(tmp_path, weights="auto"))
    assert close(sizes["float"], held_bytes(tmp_path, weights="float"))


def test_the_embedded_model_estimate_matches_the_loaded_float_model(smollm_float):
    sizes = weight_sizes.estimate(None, device="cpu")
    assert close(sizes["float"], weights_report(smollm_float.model).resident_bytes)
    # SmolLM2-135M: the 30 layers' linears shrink to 0.156x; the tied 49152 x 576 embedding (113 MB in float32)
    # is held once for table and head: as the file's Q8_0 blocks (34 bytes a 32) where "auto" keeps the Q4_1
    # layers as blocks (a CPU without AVX-512), else as one int8 table (28 MB) where the int8 kernel runs
    # (head="auto" beside int4 layers), else it stays float
    table = 49152 * 576
    if "Q4_1" in auto_block_types() and gguf_blocks.expected_unavailable("cpu") is None:
        held = table // 32 * 34
    elif int8_kernel_unavailable("cpu_int8pack", "cpu") is None:
        held = table + 2 * 49152
    else:
        held = 4 * table
    assert 0.25 * sizes["float"] < sizes["int4"] + (4 * table - held) < 0.4 * sizes["float"]
    assert sizes["outside_layers"] == held + 4 * 576  # the table and the final norm


def test_from_pretrained_takes_the_weight_format_and_reports_what_it_holds(tmp_path, one_thread):
    from engine import KVBoost

    build_model("qwen2").save_pretrained(tmp_path)
    build_tokenizer().save_pretrained(tmp_path)
    dense = KVBoost.from_pretrained(str(tmp_path), device="cpu", disk_cache_bytes=0)
    int4 = KVBoost.from_pretrained(str(tmp_path), device="cpu", disk_cache_bytes=0, weights="int4", group_size=32)
    assert dense.info().weights.format == "float32" and dense.info().weights.kernel == "dense"
    weights = int4.info().weights
    assert weights.format == "int4-g32" and weights.num_int4_linears == 14
    # memory() counts what is held: the packed codes and per-group scales, not the float parameters alone
    assert int4.memory().weights_bytes == weights.resident_bytes == weights_report(int4.model).resident_bytes
    estimate = weight_sizes.estimate(str(tmp_path), device="cpu", group_size=32)
    assert close(estimate["int4"], int4.memory().weights_bytes)
    assert close(estimate["float"], dense.memory().weights_bytes)
    assert int4.fingerprint != dense.fingerprint
    with pytest.raises(ValueError, match="weights must be one of"):
        KVBoost.from_pretrained(str(tmp_path), device="cpu", disk_cache_bytes=0, weights="int3")


def test_a_gguf_of_mixed_types_is_estimated_as_the_loader_holds_each_tensor(tmp_path, one_thread):
    """Q4_K, Q6_K and Q8_0 as the file's blocks where the block kernel runs (else Q4_K codes as int4 at their own
    groups, Q6_K / Q8_0 as int8 rows where the int8 kernel runs), F16 quantized at the asked group size, the Q8_0
    table as blocks (or int8 rows) under head="auto"."""
    from gguf_files import random_tensors, tensor_shapes, write_gguf

    values = random_tensors(tensor_shapes("llama", {"hidden": 256, "intermediate": 512}))
    kinds = {"attn": "Q4_K", "ffn_down": "Q6_K", "ffn_gate": "Q8_0", "ffn_up": "F16", "token_embd": "Q8_0"}
    typed = {name: (v, "F32" if v.ndim == 1 else next(t for k, t in kinds.items() if k in name))
             for name, v in values.items()}
    path = write_gguf(tmp_path / "mix.gguf", typed, sizes={"hidden": 256, "intermediate": 512})
    sizes = weight_sizes.estimate(str(path), device="cpu", group_size=64)
    int4_model, _ = load_model(resolve_source(str(path)), CPU, torch.float32, weights="int4", group_size=64)
    held = weights_report(int4_model)
    assert {label.split("->")[1] for label in held.gguf} >= {"int4", "float32"}
    assert close(sizes["int4"], held.resident_bytes), (sizes, held.gguf)
    assert close(sizes["float"], held_bytes(path, weights="float"))
    auto_model, _ = load_model(resolve_source(str(path)), CPU, torch.float32, weights="auto")
    assert sizes["auto"]["loads"] == auto_model.weights_choice["loaded"]
    assert sizes["auto"]["why"] == auto_model.weights_choice["why"]


def test_the_embedded_model_estimate_matches_what_the_default_load_holds(smollm):
    sizes = weight_sizes.estimate(None, device="cpu")
    assert sizes["auto"]["loads"] == smollm.model.weights_choice["loaded"] == "int4"
    assert close(sizes["int4"], weights_report(smollm.model).resident_bytes)
    assert sizes["int4"] < 0.3 * sizes["float"]
