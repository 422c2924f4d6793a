"""The output head and the embedding table in fewer bytes (engine.weights.head): int8 rows against their dequantized
weight, torch's int8 kernel within bfloat16 rounding of that, tables that look up the head's own codes, the
fingerprint telling the formats apart, and the real model with an int8 head and table."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import build_model, random_ids
from torch import nn

from engine.weights.fingerprint import fingerprint
from engine.weights.head import (
    Int4Embedding,
    Int8Embedding,
    Int8Linear,
    int8_kernel_unavailable,
    quantize_head,
    quantize_rows_int8,
)
from engine.weights.int4 import Int4Linear, dequantize_codes, quantize_rtn
from engine.weights.loader import load_model, resolve_source
from engine.weights.weights_report import weights_report

CPU_INT8 = int8_kernel_unavailable("cpu_int8pack", "cpu")
needs_int8_kernel = pytest.mark.skipif(CPU_INT8 is not None, reason=f"no CPU int8 kernel: {CPU_INT8}")


def tied(arch: str = "qwen3"):
    model = build_model(arch)
    model.get_output_embeddings().weight = model.get_input_embeddings().weight  # tied, as SmolLM2's are
    return model


# -- int8 rows ---------------------------------------------------------------------------------------------------

def test_int8_rows_are_within_half_a_step_of_the_weight_and_the_largest_maps_to_127():
    weight = torch.randn(40, 96, generator=torch.Generator().manual_seed(0))
    weight[5] = 0  # an all-zero row: any scale is exact
    codes, scales = quantize_rows_int8(weight)
    assert codes.dtype == torch.int8 and scales.shape == (40,)
    back = codes.float() * scales[:, None]
    assert torch.all((back - weight).abs() <= scales[:, None] / 2 + 1e-7)
    assert torch.equal(codes[5], torch.zeros(96, dtype=torch.int8))
    rows = [r for r in range(40) if r != 5]
    assert torch.all(codes[rows].abs().amax(dim=1) == 127)


def test_the_reference_int8_head_multiplies_by_its_dequantized_weight():
    weight = torch.randn(64, 48, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(64, generator=torch.Generator().manual_seed(2))
    layer = Int8Linear.from_float(weight, bias, "reference")
    codes, scales = quantize_rows_int8(weight)
    x = torch.randn(2, 3, 48, generator=torch.Generator().manual_seed(3))
    want = x @ (codes.float() * scales[:, None]).t() + bias
    assert torch.allclose(layer(x), want, atol=1e-5, rtol=0)


@needs_int8_kernel
def test_the_cpu_int8_kernel_is_within_bf16_rounding_of_the_reference():
    gen = torch.Generator().manual_seed(4)
    weight, x = torch.randn(128, 576, generator=gen), torch.randn(5, 576, generator=gen)
    fast, reference = Int8Linear.from_float(weight, None, "cpu_int8pack"), Int8Linear.from_float(weight, None,
                                                                                                  "reference")
    got, want = fast(x), reference(x)
    # x and the scale rounded to bfloat16 (2^-9 relative each), the output too: |error| <= 2^-7 sum |x| |w|
    bound = 2**-7 * (x.abs() @ reference.dequantize().abs().t())
    assert torch.all((got - want).abs() <= bound)
    assert (got - want).abs().max() > 0  # it did compute in bfloat16: the test tells the paths apart


def test_an_int8_head_keeps_a_tied_tables_float_rows_and_an_int8_table_looks_up_the_heads_codes(one_thread):
    model = tied()
    embedding = model.get_input_embeddings().weight.detach().clone()
    assert quantize_head(model, "int8", kernel="reference")["embedding"] == "float32"
    assert isinstance(model.get_input_embeddings(), nn.Embedding)
    assert torch.equal(model.get_input_embeddings().weight, embedding)

    model = tied()
    report = quantize_head(model, "int8+embedding")
    assert report["head"] == "int8" == report["embedding"]
    table, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(table, Int8Embedding) and isinstance(head, Int8Linear)
    ids = torch.tensor([[5, 0, 17], [3, 3, 9]])
    assert torch.equal(table(ids), head.dequantize(torch.float32)[ids])
    codes, scales = quantize_rows_int8(embedding)
    assert torch.allclose(table(ids), (codes.float() * scales[:, None])[ids], rtol=2**-8, atol=0)
    assert table.codes is head.codes  # one copy of the codes
    assert not any(p.numel() == embedding.numel() for p in model.parameters())  # the float table is gone
    with torch.inference_mode():
        assert model(torch.tensor([random_ids(16, seed=5)])).logits.isfinite().all()


@pytest.mark.parametrize("head", ["int8+embedding", "int4+embedding"])
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_a_scaled_table_keeps_its_scale_in_int8_and_int4(arch, head, one_thread):
    model = build_model(arch)  # Gemma's table multiplies its rows by sqrt(hidden size)
    table = model.get_input_embeddings()
    assert float(table.embed_scale) == 8.0
    ids = torch.tensor([[5, 0, 17], [3, 3, 9]])
    want, largest = table(ids).detach(), float(table.weight.detach().abs().max())
    quantize_head(model, head, group_size=32, kernel="reference")
    held = model.get_input_embeddings()
    assert isinstance(held, Int8Embedding if head.startswith("int8") else Int4Embedding)
    # the rows' own rounding (int8: half a step of max |w| / 127; int4: of its group), times the scale
    assert torch.allclose(held(ids), want, atol=8.0 * largest / (254 if "8" in head else 15))
    assert not torch.allclose(held(ids), want / 8.0, atol=1e-3)


def test_an_int8_table_changes_the_fingerprint_and_so_does_an_int8_head(one_thread):
    base = tied()
    with_head, with_table = copy.deepcopy(base), copy.deepcopy(base)
    quantize_head(with_head, "int8")
    quantize_head(with_table, "int8+embedding")
    assert len({fingerprint(base), fingerprint(with_head), fingerprint(with_table)}) == 3


def test_an_unknown_head_format_is_refused():
    with pytest.raises(ValueError, match="head must be one of"):
        quantize_head(tied(), "int2")


def test_an_int4_head_multiplies_by_its_dequantized_weight_and_a_tied_table_keeps_the_float_rows(one_thread):
    model = build_model("qwen3")
    model.get_output_embeddings().weight = model.get_input_embeddings().weight  # tied, as SmolLM2's are
    embedding = model.get_input_embeddings().weight.detach().clone()
    report = quantize_head(model, "int4", group_size=32, kernel="reference")
    assert report == {"head": "int4-g32", "embedding": "float32", "reason": None}
    head = model.get_output_embeddings()
    assert isinstance(head, Int4Linear) and isinstance(model.get_input_embeddings(), nn.Embedding)
    assert torch.equal(model.get_input_embeddings().weight, embedding)
    codes, scales, zeros = quantize_rtn(embedding, 32)
    assert torch.equal(head.dequantize(torch.float32), dequantize_codes(codes, scales, zeros, embedding.shape[1]))
    x = torch.randn(4, embedding.shape[1], generator=torch.Generator().manual_seed(3))
    assert torch.allclose(head(x), x @ dequantize_codes(codes, scales, zeros, embedding.shape[1]).t(), atol=1e-5)


def test_an_int4_table_looks_up_the_rows_of_the_int4_head(one_thread):
    model = build_model("qwen3")
    model.get_output_embeddings().weight = model.get_input_embeddings().weight
    embedding = model.get_input_embeddings().weight.detach().clone()
    report = quantize_head(model, "int4+embedding", group_size=32, kernel="reference")
    assert report["embedding"] == "int4-g32" == report["head"]
    table = model.get_input_embeddings()
    assert isinstance(table, Int4Embedding) and table.num_embeddings == embedding.shape[0]
    ids = torch.tensor([[5, 0, 17], [3, 3, 9]])
    codes, scales, zeros = quantize_rtn(embedding, 32)
    rows = dequantize_codes(codes, scales, zeros, embedding.shape[1])
    assert torch.equal(table(ids), rows[ids])
    assert torch.equal(table(ids), model.get_output_embeddings().dequantize(torch.float32)[ids])
    with torch.inference_mode():
        assert model(torch.tensor([random_ids(16, seed=5)])).logits.isfinite().all()
    assert not any(p.numel() == embedding.numel() for p in model.parameters())  # the float table is gone


@needs_int8_kernel
def test_the_real_model_with_int4_weights_and_an_int8_head_and_table_answers(smollm_float, one_thread):
    model, tokenizer = load_model(resolve_source(None), torch.device("cpu"), torch.float32, weights="int4",
                                  head="int8+embedding")
    report = weights_report(model)
    assert report.head == "int8" == report.embedding and report.head_kernel == "cpu_int8pack"
    float_table = smollm_float.model.get_input_embeddings().weight
    # the int8 codes once (1 byte per weight) instead of the float32 table: 3/4 of the table's bytes gone
    assert report.resident_bytes < weights_report(smollm_float.model).resident_bytes - 0.7 * float_table.nbytes
    from engine import EngineConfig, KVBoost

    engine = KVBoost(model, tokenizer, EngineConfig.of(disk_cache_bytes=0))
    assert "Paris" in engine.chat([{"role": "user", "content": "What is the capital of France?"}],
                                  max_new_tokens=12).text


@pytest.mark.parametrize("head", ["int8+embedding", "int4+embedding"])
def test_an_untied_table_is_quantized_from_its_own_rows_not_the_heads(head, one_thread):
    model = build_model("qwen3")
    assert model.get_input_embeddings().weight is not model.get_output_embeddings().weight
    embedding = model.get_input_embeddings().weight.detach().clone()
    quantize_head(model, head, group_size=32, kernel="reference")
    ids = torch.tensor([[5, 0, 17, 3]])
    step = embedding.abs().amax(dim=1, keepdim=True)[ids[0]] / (127 if head.startswith("int8") else 7)
    assert torch.all((model.get_input_embeddings()(ids)[0] - embedding[ids[0]]).abs() <= step)
