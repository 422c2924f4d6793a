"""Tiny GPTQ checkpoints for tests, written the way AutoGPTQ / GPTQModel write desc_act=False 4-bit ones, by code
independent of the engine's reader: a packer from the format's layout, a round-to-nearest quantizer, safetensors +
config.json + tokenizer files."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tiny_models import ARCHS, EOS, build_tokenizer
from transformers import AutoModelForCausalLM

DECODER_LINEAR = re.compile(r"layers\.\d+\.")


def pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """[K, N] integer codes 0..15 -> int32 [K/8, N]: row 8i + j in bits 4j..4j+3 of word [i, n]."""
    rows, cols = codes.shape
    assert rows % 8 == 0 and int(codes.min()) >= 0 and int(codes.max()) <= 15
    words = torch.zeros(rows // 8, cols, dtype=torch.int64)
    for j in range(8):
        words |= codes[j::8].to(torch.int64) << (4 * j)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # two's complement, as stored


def pack_columns(values: torch.Tensor) -> torch.Tensor:
    """[R, N] integers 0..15 -> int32 [R, N/8]: column 8c + j in bits 4j..4j+3 of word [r, c]."""
    return pack_rows(values.t().contiguous()).t().contiguous()


def quantize_gptq(weight: torch.Tensor, group_size: int, sym: bool):
    """weight [N, K] -> (codes [N, K], scales fp16 [N, K/G], zeros [N, K/G]), w ~= (q - zero) * scale, as GPTQ's
    Quantizer finds them without the error feedback: min/max per group widened to include 0; symmetric: the range
    +-max|w| and zero 8."""
    out_features, in_features = weight.shape
    g = weight.double().view(out_features, in_features // group_size, group_size)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    if sym:
        top = torch.maximum(-lo, hi)
        lo, hi = -top, top
    scales = ((hi - lo) / 15).clamp(min=1e-4).half()
    zeros = torch.full_like(lo, 8) if sym else torch.round(-lo / scales.double()).clamp(0, 15)
    codes = torch.round(g / scales.double()[..., None] + zeros[..., None]).clamp(0, 15)
    return codes.reshape(out_features, in_features).to(torch.int64), scales, zeros.to(torch.int64)


def stored_zeros(zeros: torch.Tensor, fmt: str) -> torch.Tensor:
    """What the file holds for each zero: zero - 1 in the classic format (a zero 0 wraps to -1, nibble 15, as
    AutoGPTQ's pack makes it), the zero itself in gptq_v2."""
    return (zeros - 1) & 0xF if fmt == "gptq" else zeros


def meant_zeros(stored: torch.Tensor, fmt: str) -> torch.Tensor:
    return stored + 1 if fmt == "gptq" else stored


def dequantized(codes, scales, zeros, group_size: int) -> torch.Tensor:
    """The float64 [N, K] weight of codes [N, K], scales and zeros [N, K/G]."""
    s = scales.double().repeat_interleave(group_size, dim=1)
    z = zeros.double().repeat_interleave(group_size, dim=1)
    return (codes.double() - z) * s


def write_gptq_checkpoint(folder: Path, arch: str, group_size: int = 32, *, sym: bool = False, fmt: str = "gptq",
                          tie: bool = False, positive_group: bool = True) -> dict:
    """A tiny random `arch` model as a GPTQ checkpoint in `folder` (group_size -1: one group per row). With
    `positive_group` the first group of every q_proj is made all-positive (zero 0, which the classic format
    stores as nibble 15: zero 16). Returns {linear name: float64 weight [out, in]} of every quantized linear, the
    weights the checkpoint means."""
    make_config, _ = ARCHS[arch]
    config = make_config()
    config.tie_word_embeddings = tie
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight[EOS].zero_()  # as tiny_models.build_model: EOS never wins
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if tie:
        state.pop("lm_head.weight", None)
    expected = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or not DECODER_LINEAR.search(name):
            continue
        weight = module.weight.detach().clone()
        g = weight.shape[1] if group_size == -1 else group_size
        if positive_group and name.endswith("q_proj") and not sym:
            weight[:, :g] = weight[:, :g].abs()
        codes, scales, zeros = quantize_gptq(weight, g, sym)
        stored = stored_zeros(zeros, fmt)
        del state[f"{name}.weight"]
        state[f"{name}.qweight"] = pack_rows(codes.t().contiguous())  # [K/8, N]
        state[f"{name}.qzeros"] = pack_columns(stored.t().contiguous())  # [K/G, N/8]
        state[f"{name}.scales"] = scales.t().contiguous()  # [K/G, N] fp16
        state[f"{name}.g_idx"] = (torch.arange(weight.shape[1]) // g).to(torch.int32)
        if module.bias is not None:
            state[f"{name}.bias"] = module.bias.detach().half().clone()
        expected[name] = dequantized(codes, scales, meant_zeros(stored, fmt), g)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config_json = config.to_dict()
    config_json["architectures"] = [type(model).__name__]
    config_json["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group_size,
                                          "desc_act": False, "sym": sym, "checkpoint_format": fmt,
                                          "damp_percent": 0.01, "true_sequential": True}
    (folder / "config.json").write_text(json.dumps(config_json, indent=2, default=str))
    build_tokenizer().save_pretrained(str(folder))
    return expected


def rewritten(source: Path, dest: Path, *, tensors=None, quantization=None) -> Path:
    """A copy of checkpoint `source` at `dest`, its tensors dict passed through `tensors(state)` (changed in place)
    and its quantization_config through `quantization(dict)`."""
    shutil.copytree(source, dest)
    if tensors is not None:
        state = load_file(str(source / "model.safetensors"))
        tensors(state)
        save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
    if quantization is not None:
        config_json = json.loads((source / "config.json").read_text())
        quantization(config_json["quantization_config"])
        (dest / "config.json").write_text(json.dumps(config_json, indent=2))
    return dest
