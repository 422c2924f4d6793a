"""GPTQ checkpoints read by our own loader (engine.weights.gptq): the test packer against a dequantization written here
from the format, every loaded layer equal to the weight the checkpoint means (bit for bit on the reference path, zero 16
and one group per row included), the model's logits against a float model of those weights, and the checkpoints
it refuses, each with a GPTQFormatError naming the setting or tensor."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from awq_checkpoints import write_awq_checkpoint
from cpu_kernels import needs_cpu_kernel
from gptq_checkpoints import pack_columns, pack_rows, rewritten, write_gptq_checkpoint
from safetensors.torch import load_file
from tiny_models import random_ids
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from engine.weights.gptq import GPTQFormatError, is_gptq_folder, load_gptq_model, unpack_columns, unpack_rows
from engine.weights.int4 import Int4Linear, weights_format

CPU = torch.device("cpu")
# The int4pack kernel computes in bfloat16 (activations, and each group's scale and offset): two decoder layers'
# logits stay within a few parts in a hundred of the largest logit of the float model (as tests/engine/
# test_gguf_loader.py states for its files), bounded at 5%.
BF16_LOGIT_BOUND = 0.05
# (arch, group size, sym, checkpoint format, tied head): group 32 with zero 16 groups, group 64 symmetric, one
# group per row (64 / 128 input rows: cut into the kernel's groups) in the v2 format.
SPECS = {"llama-g32": ("llama", 32, False, "gptq", False), "qwen2-g64-sym": ("qwen2", 64, True, "gptq", True),
         "llama-row-v2": ("llama", -1, False, "gptq_v2", False)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{spec: (folder, {linear: float64 weight the checkpoint means})}"""
    root = tmp_path_factory.mktemp("gptq")
    made = {}
    for key, (arch, group_size, sym, fmt, tie) in SPECS.items():
        made[key] = (root / key, write_gptq_checkpoint(root / key, arch, group_size, sym=sym, fmt=fmt, tie=tie))
    return made


def load(folder, **options):
    return load_gptq_model(folder, AutoConfig.from_pretrained(str(folder)), CPU, torch.float32, **options)


def float_model(folder, expected):
    """The float model of the checkpoint's meaning: its float tensors as they are, each quantized linear's
    dequantized weight (float64 -> float32: exact, a 5-bit integer times an fp16 scale)."""
    config = AutoConfig.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
    state = {k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()
             if k.endswith((".weight", ".bias"))}
    state.update({f"{name}.weight": weight.float() for name, weight in expected.items()})
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(name == "lm_head.weight" for name in missing), (missing, unexpected)
    model.tie_weights()
    return model


def logits_of(model, ids):
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


def numpy_dequantized(qweight, qzeros, scales, group_size: int, zero_offset: int) -> np.ndarray:
    """The format, element by element: w[k, n] = scale[g, n] * (q - (z + zero_offset)), q nibble k % 8 of qweight
    word [k // 8, n], z nibble n % 8 of qzeros word [g, n // 8], g = k // G."""
    words, zero_words = qweight.numpy().view(np.uint32), qzeros.numpy().view(np.uint32)
    k_total, n_total = words.shape[0] * 8, words.shape[1]
    out = np.zeros((k_total, n_total))
    for k in range(k_total):
        g = k // group_size
        for n in range(n_total):
            q = (int(words[k // 8, n]) >> (4 * (k % 8))) & 0xF
            z = (int(zero_words[g, n // 8]) >> (4 * (n % 8))) & 0xF
            out[k, n] = float(scales[g, n]) * (q - (z + zero_offset))
    return out.T  # [N, K], as nn.Linear holds it


# -- the format ----------------------------------------------------------------------------------------------------

def test_the_packer_writes_rows_along_k_and_zeros_along_n_low_nibble_first():
    codes = torch.arange(8)[:, None].repeat(1, 3)  # rows 0..7 of every column
    assert pack_rows(codes).tolist() == [[0x76543210] * 3]
    assert pack_columns(torch.arange(8)[None]).tolist() == [[0x76543210]]
    assert int(pack_rows(torch.full((8, 1), 15))[0, 0]) == -1  # 0xFFFFFFFF, two's complement
    random = torch.randint(0, 16, (16, 24), generator=torch.Generator().manual_seed(3))
    assert torch.equal(unpack_rows(pack_rows(random)).long(), random)
    assert torch.equal(unpack_columns(pack_columns(random)).long(), random)


@pytest.mark.parametrize("spec", list(SPECS))
def test_the_checkpoints_mean_what_the_format_says(checkpoints, spec):
    folder, expected = checkpoints[spec]
    _, group_size, _, fmt, _ = SPECS[spec]
    state = load_file(str(folder / "model.safetensors"))
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        k = state[f"{name}.qweight"].shape[0] * 8
        want = numpy_dequantized(state[f"{name}.qweight"], state[f"{name}.qzeros"], state[f"{name}.scales"],
                                 k if group_size == -1 else group_size, 1 if fmt == "gptq" else 0)
        assert np.array_equal(want, expected[name].numpy()), name


def test_the_classic_format_test_checkpoint_holds_zero_16_groups(checkpoints):
    state = load_file(str(checkpoints["llama-g32"][0] / "model.safetensors"))
    stored = unpack_columns(state["model.layers.0.self_attn.q_proj.qzeros"])
    assert int(stored.max()) == 15  # zero 16: the all-positive first group
    assert isinstance(load(checkpoints["llama-g32"][0], kernel="reference").model.layers[0].self_attn.q_proj.offsets,
                      torch.Tensor)


# -- loading ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", list(SPECS))
def test_loaded_layers_hold_the_checkpoints_weights_bit_for_bit(checkpoints, spec, one_thread):
    assert importlib.util.find_spec("auto_gptq") is None and importlib.util.find_spec("gptqmodel") is None
    folder, expected = checkpoints[spec]
    model = load(folder, kernel="reference")
    dense = load(folder, dequantize=True)
    assert {name for name, m in model.named_modules() if isinstance(m, Int4Linear)} == set(expected)
    group_size = SPECS[spec][1]
    for name, weight in expected.items():
        layer = model.get_submodule(name)
        assert layer.origin == "gptq" and layer.kernel == "reference"
        assert layer.group_size == (layer.in_features if group_size == -1 else group_size)  # rows: 64 or 128
        assert torch.equal(layer.dequantize(torch.float32), weight.float()), name
        assert type(dense.get_submodule(name)) is nn.Linear
        assert torch.equal(dense.get_submodule(name).weight, weight.float()), name
    assert weights_format(model) == {"llama-g32": "gptq-g32", "qwen2-g64-sym": "gptq-g64",
                                     "llama-row-v2": "gptq-g64+gptq-g128"}[spec]
    if SPECS[spec][4]:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])


@pytest.mark.parametrize("spec", list(SPECS))
def test_logits_equal_the_float_model_of_the_dequantized_weights(checkpoints, spec, one_thread):
    folder, expected = checkpoints[spec]
    ids = random_ids(40, seed=5)
    want = logits_of(float_model(folder, expected), ids)
    # The reference path multiplies by the same float32 weights: the same logits, bit for bit.
    assert torch.equal(logits_of(load(folder, kernel="reference"), ids), want)
    assert torch.equal(logits_of(load(folder, dequantize=True), ids), want)


@needs_cpu_kernel
@pytest.mark.parametrize("spec", list(SPECS))
def test_on_the_cpu_int4_kernel_logits_are_within_the_bf16_bound(checkpoints, spec, one_thread):
    folder, expected = checkpoints[spec]
    model = load(folder)
    assert {m.kernel for m in model.modules() if isinstance(m, Int4Linear)} == {"cpu_int4pack"}
    ids = random_ids(40, seed=5)
    want = logits_of(float_model(folder, expected), ids)
    assert (logits_of(model, ids) - want).abs().max() <= BF16_LOGIT_BOUND * float(want.abs().max())


def test_progress_is_reported_after_each_decoder_layer(checkpoints):
    steps = []
    load(checkpoints["llama-g32"][0], kernel="reference", progress=lambda *step: steps.append(step))
    assert steps == [(1, 3, "layer 1 of 2"), (2, 3, "layer 2 of 2"), (3, 3, "output head, embeddings and norms")]


def test_a_gptq_folder_is_told_from_others(checkpoints, tmp_path):
    assert is_gptq_folder(checkpoints["llama-g32"][0])
    write_awq_checkpoint(tmp_path / "awq", "llama", 32)
    assert not is_gptq_folder(tmp_path / "awq") and not is_gptq_folder(tmp_path / "none")


# -- refused checkpoints ---------------------------------------------------------------------------------------------

Q = "model.layers.0.self_attn.q_proj"


def set_entry(key, value):
    return lambda quant: quant.__setitem__(key, value)


@pytest.mark.parametrize("change,message", [
    (set_entry("desc_act", True), "desc_act"),
    (set_entry("bits", 8), "bits=8"),
    (set_entry("checkpoint_format", "marlin"), "marlin"),
    (set_entry("group_size", 48), "group_size"),
    (set_entry("dynamic", {"-:.*down_proj": {}}), "dynamic"),
])
def test_settings_this_loader_does_not_read_are_clear_errors(checkpoints, tmp_path, change, message):
    folder = rewritten(checkpoints["llama-g32"][0], tmp_path / "changed", quantization=change)
    with pytest.raises(GPTQFormatError, match=message):
        load(folder, kernel="reference")


def reordered_g_idx(state):
    state[f"{Q}.g_idx"] = state[f"{Q}.g_idx"].flip(0).contiguous()  # an act-order layer's


def scales_of_group_64(state):
    state[f"{Q}.scales"] = state[f"{Q}.scales"][::2].contiguous()


def int8_qweight(state):
    state[f"{Q}.qweight"] = state[f"{Q}.qweight"].to(torch.int8)


def without_qzeros(state):
    del state[f"{Q}.qzeros"]


def quantized_head(state):
    state["lm_head.qweight"] = torch.zeros(8, 512, dtype=torch.int32)


def extra_tensor(state):
    state["model.layers.0.mlp.extra"] = torch.zeros(3)


@pytest.mark.parametrize("change,message", [
    (reordered_g_idx, f"{Q}.g_idx"),
    (scales_of_group_64, rf"{Q}.scales.*shape"),
    (int8_qweight, rf"{Q}.qweight.*I8"),
    (without_qzeros, f"{Q}.qzeros"),
    (quantized_head, "lm_head.qweight"),
    (extra_tensor, "model.layers.0.mlp.extra"),
])
def test_tensors_that_disagree_with_the_config_are_errors_naming_them(checkpoints, tmp_path, change, message):
    folder = rewritten(checkpoints["llama-g32"][0], tmp_path / "changed", tensors=change)
    with pytest.raises(GPTQFormatError, match=message):
        load(folder, kernel="reference")


def test_a_g_idx_check_reads_values_not_only_shapes(checkpoints, tmp_path):
    """g_idx of group 64 in a group-32 checkpoint: the right shape and dtype, the wrong groups."""
    def group_64(state):
        state[f"{Q}.g_idx"] = (torch.arange(64) // 64).to(torch.int32)

    folder = rewritten(checkpoints["llama-g32"][0], tmp_path / "changed", tensors=group_64)
    with pytest.raises(GPTQFormatError, match=rf"{Q}.g_idx.*k // 32"):
        load(folder, kernel="reference")
