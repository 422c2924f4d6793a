"""Tiny AWQ checkpoints for tests, written the way AutoAWQ writes GEMM checkpoints, by code independent of the
engine's reader: a nibble packer, a round-to-nearest quantizer, safetensors + config.json + tokenizer files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file
from tiny_models import ARCHS, EOS, build_tokenizer
from transformers import AutoModelForCausalLM

# Nibble j of every int32 word holds output column PACK_ORDER[j] of its 8 (AutoAWQ's GEMM order).
PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
DECODER_LINEAR = re.compile(r"layers\.\d+\.")


def pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """[R, C] integer codes 0..15 -> int32 [R, C/8] words (two's complement, as safetensors stores them)."""
    rows, cols = codes.shape
    assert cols % 8 == 0 and int(codes.min()) >= 0 and int(codes.max()) <= 15
    words = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for nibble, column in enumerate(PACK_ORDER):
        words |= codes[:, column::8].to(torch.int64) << (4 * nibble)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def quantize_awq(weight: torch.Tensor, group_size: int):
    """weight [out, in] -> (codes [out, in], scales fp16 [out, in/G], zeros [out, in/G]) with the group range
    widened to include 0; w ~= (q - zero) * scale with the fp16 scale."""
    out_features, in_features = weight.shape
    g = weight.double().view(out_features, in_features // group_size, group_size)
    lo = g.amin(-1).clamp(max=0)
    hi = g.amax(-1).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-4).half()
    zeros = torch.round(-lo / scales.double()).clamp(0, 15)
    codes = torch.round(g / scales.double()[..., None] + zeros[..., None]).clamp(0, 15)
    return codes.reshape(out_features, in_features).to(torch.int64), scales, zeros.to(torch.int64)


def dequantized(codes, scales, zeros, group_size: int) -> torch.Tensor:
    """The float64 [out, in] weight an AWQ layer stands for."""
    s = scales.double().repeat_interleave(group_size, dim=1)
    z = zeros.double().repeat_interleave(group_size, dim=1)
    return (codes.double() - z) * s


def write_awq_checkpoint(folder: Path, arch: str, group_size: int = 32, *, tie: bool = False,
                         not_converted: tuple[str, ...] = ()) -> dict:
    """A tiny random `arch` model as an AWQ checkpoint in `folder`. Returns {linear name: float64 weight [out, in]}
    of every quantized linear, the weights the loaded model must multiply by."""
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
        if any(skip in name for skip in not_converted):
            continue
        codes, scales, zeros = quantize_awq(module.weight.detach(), group_size)
        del state[f"{name}.weight"]
        state[f"{name}.qweight"] = pack_awq(codes.t().contiguous())  # [in, out/8]
        state[f"{name}.qzeros"] = pack_awq(zeros.t().contiguous())  # [in/G, out/8]
        state[f"{name}.scales"] = scales.t().contiguous()  # [in/G, out] fp16
        if module.bias is not None:
            state[f"{name}.bias"] = module.bias.detach().half().clone()
        expected[name] = dequantized(codes, scales, zeros, group_size)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config_json = config.to_dict()
    config_json["architectures"] = [type(model).__name__]
    config_json["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size,
                                          "version": "gemm", "zero_point": True,
                                          "modules_to_not_convert": list(not_converted) or None}
    (folder / "config.json").write_text(json.dumps(config_json, indent=2, default=str))
    build_tokenizer().save_pretrained(str(folder))
    return expected
