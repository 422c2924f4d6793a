"""GGUF Q4_0 / Q4_1 / Q4_K blocks read as int4 layers as they are: against gguf's own dequantize, against the float
weights transformers loads from the real model's GGUF (llama's q/k row permutation included), the int4pack kernel
within its bfloat16 rounding."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from cpu_kernels import needs_cpu_kernel  # noqa: E402
from gguf import GGMLQuantizationType, quants
from gguf_files import encode
from tiny_models import random_ids

from engine.weights.fingerprint import fingerprint
from engine.weights.gguf_int4 import GGUFBlocks, decode_blocks
from engine.weights.int4 import Int4Linear, decoder_linears, dequantize_codes, quantize_model
from engine.weights.loader import default_model_path, load_model, resolve_source
from engine.weights.weights_report import weights_report


def kernel_bound(weight: torch.Tensor, scales: torch.Tensor, kernel_offsets: torch.Tensor) -> torch.Tensor:
    """How far the int4pack kernel's dequantized weight may be from the exact one: it holds scale and the kernel
    offset in bfloat16 (2^-9 of each; |q - 8| <= 8) and rounds the weight it reads back to bfloat16 (2^-9 |w|)."""
    s = scales.repeat_interleave(32, dim=1)
    o = kernel_offsets.repeat_interleave(32, dim=1)
    return 2**-8 * (weight.abs() + 8 * s + o.abs())


# -- blocks against gguf's dequantize ----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_decoded_blocks_dequantize_exactly_as_gguf_does(kind):
    qtype = GGMLQuantizationType[kind]
    rng = np.random.default_rng(7)
    weight = (rng.standard_normal((48, 256)) * 0.05).astype(np.float32)
    weight[3] += 0.2  # a row of mostly positive weights: m far from 0
    blocks = encode(weight, kind)  # uint8 [48, bytes]: gguf-py's quantizer, the tests' own for Q4_K
    expected = torch.from_numpy(quants.dequantize(blocks, qtype))
    codes, scales, zeros, offsets = decode_blocks(blocks, kind)
    assert codes.shape == (48, 256) and scales.shape == zeros.shape == (48, 8)
    assert (offsets is None) == (kind == "Q4_0")
    assert torch.equal(dequantize_codes(codes, scales, zeros, 256, torch.float32, offsets), expected)
    layer = Int4Linear.from_codes(codes, scales, zeros, 256, None, "reference", origin=f"gguf-{kind.lower()}",
                                  offsets=offsets)
    assert torch.equal(layer.dequantize(torch.float32), expected)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(layer(x), x @ expected.t(), atol=1e-5, rtol=0)


@needs_cpu_kernel
def test_a_q4_1_layer_on_the_cpu_kernel_is_within_bf16_rounding_of_gguf():
    rng = np.random.default_rng(8)
    weight = (rng.standard_normal((64, 576)) * 0.05 + 0.03).astype(np.float32)
    blocks = quants.quantize(weight, GGMLQuantizationType.Q4_1)
    expected = torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType.Q4_1))
    codes, scales, zeros, offsets = decode_blocks(blocks, "Q4_1")
    fast = Int4Linear.from_codes(codes, scales, zeros, 576, None, "cpu_int4pack", offsets=offsets)
    got = fast.dequantize(torch.float32)
    assert torch.all((got - expected).abs() <= kernel_bound(expected, scales, offsets + 8 * scales))
    assert (got - expected).abs().max() > 0  # bfloat16, not the reference path


# -- the real model ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real_blocks(smollm_float):
    return GGUFBlocks(default_model_path(), smollm_float.model)


def test_every_q4_1_linear_of_the_real_model_maps_to_exactly_transformers_float_weight(smollm_float, real_blocks):
    linears = decoder_linears(smollm_float.model)
    assert len(linears) == 30 * 7 and real_blocks.refused == {}
    permuted = 0
    for name, linear in linears:
        layer = real_blocks.layer(name, linear, "reference")
        assert layer is not None and layer.origin == "gguf-q4_1" and layer.group_size == 32, name
        # bit for bit: transformers dequantizes the same blocks in float32 (d * q + m) and so does the reference
        assert torch.equal(layer.dequantize(torch.float32), linear.weight), name
        permuted += real_blocks.tensors[f"{name}.weight"][2] is not None
    assert permuted == 2 * 30  # attn_q and attn_k of every layer carry llama.cpp's row permutation


def test_without_the_row_permutation_q_proj_would_differ(smollm_float, real_blocks):
    tensor, kind, order = real_blocks.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert order is not None
    codes, scales, zeros, offsets = decode_blocks(np.asarray(tensor.data), kind)
    weight = smollm_float.model.get_submodule("model.layers.0.self_attn.q_proj").weight
    unpermuted = dequantize_codes(codes, scales, zeros, 576, torch.float32, offsets)
    assert not torch.equal(unpermuted, weight)
    assert torch.equal(unpermuted[torch.from_numpy(order)], weight)


@needs_cpu_kernel
def test_the_real_models_q4_1_layers_on_the_cpu_kernel_are_within_bf16_rounding(smollm_float, real_blocks):
    for name, linear in decoder_linears(smollm_float.model)[:14]:  # two decoder layers: every projection shape
        tensor, kind, order = real_blocks.tensors[f"{name}.weight"]
        layer = real_blocks.layer(name, linear, "cpu_int4pack")
        assert layer.kernel == "cpu_int4pack"
        _, scales, _, offsets = decode_blocks(np.asarray(tensor.data), kind)
        if order is not None:
            scales, offsets = scales[torch.from_numpy(order)], offsets[torch.from_numpy(order)]
        w = linear.weight.detach()
        assert torch.all((layer.dequantize(torch.float32) - w).abs() <= kernel_bound(w, scales, offsets + 8 * scales))


def test_quantizing_the_real_model_takes_its_blocks_and_reports_them(smollm_float, real_blocks, one_thread):
    model = copy.deepcopy(smollm_float.model)
    report = quantize_model(model, group_size=128, kernel="reference", layers_from=real_blocks.layer)
    assert report["format"] == "gguf-q4_1-g32" == weights_report(model).format
    assert report["kernels"] == {"reference": 210}
    ids = torch.tensor([random_ids(24, seed=2)])
    with torch.inference_mode():  # the same weights, bit for bit: the same logits up to matmul order
        assert (model(ids).logits - smollm_float.model(ids).logits).abs().max() < 1e-3


@needs_cpu_kernel
def test_load_model_reads_a_q4_1_gguf_as_int4_with_an_int4_head(smollm_float, one_thread):
    model, _ = load_model(resolve_source(None), torch.device("cpu"), torch.float32, weights="int4", head="int4",
                          kernel="cpu_int4pack")
    report = weights_report(model)
    assert report.format == "gguf-q4_1-g32" and report.kernel == "cpu_int4pack"
    assert report.head == "int4-g128" and report.embedding == "float32"
    # per 32 weights: 16 bytes of codes, a bfloat16 scale and offset (the size of the Q4_1 block itself: 20 / 128
    # bytes = 0.156 of float32)
    assert report.linear_bytes == sum(m.out_features * m.in_features * 20 // 32 for _, m in
                                         decoder_linears(smollm_float.model))
    float_head = smollm_float.model.get_output_embeddings().weight
    assert 0 < report.head_bytes < float_head.numel() * 4 / 6


def test_the_gguf_loader_builds_the_int4_model_the_blocks_made_over_transformers_float_model(smollm_float, real_blocks,
                                                                                            one_thread):
    # before engine.weights.gguf_loader, weights="int4" was transformers' float model with each linear replaced
    # by its blocks
    before = copy.deepcopy(smollm_float.model)
    quantize_model(before, group_size=128, kernel="reference", layers_from=real_blocks.layer)
    now, _ = load_model(resolve_source(None), torch.device("cpu"), torch.float32, weights="int4", kernel="reference",
                        head="float")
    ids = torch.tensor([random_ids(24, seed=3)])
    with torch.inference_mode():
        assert torch.equal(now(ids).logits, before(ids).logits)
    assert fingerprint(now) == fingerprint(before)  # KV stored under either load is found by the other
