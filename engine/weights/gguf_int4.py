"""GGUF Q4_0 / Q4_1 / Q4_K blocks as int4 layers as they are: no dequantize-then-requantize round trip.

A Q4_0 / Q4_1 block covers 32 consecutive weights of one row (GGML_BLOCK_BYTES below); its 16 bytes of nibbles
hold element i in the low nibble of byte i for i < 16 and element i in the high nibble of byte i - 16 for i >= 16
(gguf's `quants.Q4_1.dequantize_blocks`):

    Q4_1: fp16 d, fp16 m, 16 bytes   w = q * d + m       -> canonical zero 0, scale d, offset m
    Q4_0: fp16 d, 16 bytes           w = (q - 8) * d     -> canonical zero 8, scale d, no offset

A Q4_K superblock covers 256 weights as 8 sub-blocks of 32: fp16 d, fp16 dmin, 12 bytes holding a 6-bit scale sc
and a 6-bit min m per sub-block, 128 bytes of nibbles (32-byte chunk j: sub-block 2j in the low nibbles, 2j + 1
in the high ones):

    Q4_K: w = (d * sc) * q - dmin * m                    -> canonical zero 0, scale d * sc, offset -(dmin * m)

All evaluate, in float32, the expression gguf's dequantize evaluates (the products d * sc and dmin * m in float32
first, as gguf does), so the reference path reproduces gguf's dequantized weight bit for bit (group size 32).
The int4pack kernels hold each group's scale and offset in bfloat16 (engine.weights.int4), so on those d * sc and the
kernel offset 8 * d * sc - dmin * m are rounded to bfloat16 once, at load.

Names and transforms are transformers' own (its legacy GGUF loader, `modeling_gguf_pytorch_utils`): the GGUF ->
HF name map, and the architecture's TensorProcessor, which for llama reverses llama.cpp's row permutation of
attn_q / attn_k. A transform is applied to the blocks only when probing it with an index array shows it to be a
pure permutation of whole rows (columns untouched); anything else keeps the dequantized float weight (quantized
at load instead, logged). Every mapped layer is also checked against the float weight transformers loaded.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .int4 import Int4Linear, dequantize_codes, shape_problem

log = logging.getLogger(__name__)

BLOCK = 32  # weights per Q4_0 / Q4_1 block, and per Q4_K sub-block
GGML_BLOCK_BYTES = {"Q4_0": 2 + 16, "Q4_1": 2 + 2 + 16}
Q4_K_BYTES = 2 + 2 + 12 + 128  # per superblock of 256 weights
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # the GGUF types whose codes an Int4Linear holds as they are


@contextlib.contextmanager
def memoized_name_maps():
    """Within the block, gguf's `get_tensor_name_map(arch, num_blocks)` answers repeated questions from a cache.

    transformers' GGUF loader (`get_gguf_hf_weights_map`) calls it once per submodule of the model, and each call
    builds the whole architecture's name table again (~800 calls for a 30-layer model: several seconds of every
    GGUF load, twice with GGUFBlocks). The table depends only on its two arguments and is only read, so one per
    argument pair gives the same answers. Loads run on the engine's one thread; the original is put back after.
    """
    try:
        import gguf
    except ImportError:
        yield
        return
    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


class GGUFBlocks:
    """The Q4_0 / Q4_1 tensors of one GGUF file, by HF parameter name of the model being loaded, with the row
    permutation (or None) transformers applies to each. Built once per load; blocks are read from the file's
    memory map when a layer asks for them."""

    def __init__(self, path: str | Path, model):
        from gguf import GGUFReader

        self.path = str(path)
        reader = GGUFReader(self.path)
        self.architecture = _field(reader, "general.architecture")
        self.tensors: dict[str, tuple] = {}  # hf weight name -> (gguf tensor, type name, row order or None)
        self.refused: dict[str, str] = {}  # hf weight name -> why its blocks are not used
        reason = unmappable_architecture(self.architecture)
        if reason is not None:
            log.info("GGUF %s: int4 from the dequantized weights (%s)", self.architecture, reason)
            self.refused["*"] = reason
            return
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

        processor = TENSOR_PROCESSORS.get(self.architecture, TensorProcessor)(config=_processor_config(model))
        names = get_gguf_hf_weights_map(model, processor)
        for tensor in reader.tensors:
            kind = tensor.tensor_type.name
            if kind not in GGML_BLOCK_BYTES or len(tensor.shape) != 2:
                continue
            out_features, in_features = int(tensor.shape[1]), int(tensor.shape[0])  # GGML order: [in, out]
            order, why = row_order(processor, tensor.name, out_features, in_features)
            hf_name = names.get(tensor.name)
            if hf_name is None:
                continue
            if why is not None:
                log.info("GGUF %s (%s): int4 from the dequantized weight (%s)", tensor.name, hf_name, why)
                self.refused[hf_name] = why
                continue
            self.tensors[hf_name] = (tensor, kind, order)

    def layer(self, name: str, linear: nn.Linear, kernel: str) -> Int4Linear | None:
        """The Int4Linear of decoder linear `name` from its blocks, or None (not Q4_0/Q4_1, or not exact)."""
        entry = self.tensors.get(f"{name}.weight")
        if entry is None:
            return None
        tensor, kind, order = entry
        codes, scales, zeros, offsets = decode_blocks(np.asarray(tensor.data), kind)
        if order is not None:
            index = torch.from_numpy(order)
            codes, scales, zeros = codes[index], scales[index], zeros[index]
            offsets = offsets[index] if offsets is not None else None
        expected = (linear.out_features, linear.in_features)
        if tuple(codes.shape) != expected:
            self._refuse(name, f"blocks hold {tuple(codes.shape)}, the layer is {expected}")
            return None
        # The float weight transformers loaded from these same blocks: the mapping must reproduce it exactly.
        weight = linear.weight.detach()
        ours = dequantize_codes(codes, scales, zeros, linear.in_features, torch.float32, offsets).to(weight.device)
        if not torch.equal(ours.to(weight.dtype), weight):
            diff = (ours - weight.float()).abs().max().item()
            self._refuse(name, f"dequantized blocks differ from the loaded weight by up to {diff:.3g}")
            return None
        device = weight.device
        if shape_problem(kernel, *expected) is not None:
            kernel = "reference"
        layer = Int4Linear.from_codes(codes.to(device), scales.to(device), zeros.to(device), linear.in_features,
                                      linear.bias, kernel, origin=f"gguf-{kind.lower()}",
                                      offsets=None if offsets is None else offsets.to(device))
        layer.fallback_reason = shape_problem(kernel, *expected)
        return layer

    def _refuse(self, name: str, why: str) -> None:
        log.info("GGUF %s: int4 from the dequantized weight (%s)", name, why)
        self.refused[f"{name}.weight"] = why


def decode_blocks(blocks: np.ndarray, kind: str):
    """uint8 [out, in/32 * block bytes] (Q4_K: in/256 * 144) -> (codes uint8 [out, in], scales float32
    [out, in/32], zeros uint8, offsets float32 or None), canonical: w = (q - zero) * scale + offset."""
    if kind == "Q4_K":
        return decode_q4_k(blocks)
    out_features = blocks.shape[0]
    raw = torch.from_numpy(np.array(blocks))  # a copy: the file is mapped read-only
    raw = raw.view(out_features, -1, GGML_BLOCK_BYTES[kind])
    scales = raw[..., 0:2].contiguous().view(torch.float16)[..., 0].to(torch.float32)  # [out, groups]
    if kind == "Q4_1":
        offsets = raw[..., 2:4].contiguous().view(torch.float16)[..., 0].to(torch.float32)
        zeros = torch.zeros(scales.shape, dtype=torch.uint8)
    else:
        offsets, zeros = None, torch.full(scales.shape, 8, dtype=torch.uint8)
    nibbles = raw[..., -16:]  # [out, groups, 16]: element i low nibble of byte i, element 16 + i high nibble
    codes = torch.cat([nibbles & 0xF, nibbles >> 4], dim=-1).reshape(out_features, -1)
    return codes, scales, zeros, offsets


def decode_q4_k(blocks: np.ndarray):
    """Q4_K uint8 [out, in/256 * 144] -> canonical (codes [out, in], scales d * sc [out, in/32], zeros 0,
    offsets -(dmin * m)), each product in float32 as gguf's `quants.Q4_K.dequantize_blocks` forms it."""
    out_features = blocks.shape[0]
    raw = torch.from_numpy(np.array(blocks)).view(out_features, -1, Q4_K_BYTES)  # [out, superblocks, 144]
    d = raw[..., 0:2].contiguous().view(torch.float16)[..., 0].to(torch.float32)  # [out, S]
    dmin = raw[..., 2:4].contiguous().view(torch.float16)[..., 0].to(torch.float32)
    packed = raw[..., 4:16].to(torch.int32)  # 12 bytes: sub-blocks 0-3 in bytes 0-7, 4-7 split over all 12
    low, high, extra = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat([low & 63, (extra & 15) | ((low >> 2) & 48)], dim=-1)  # [out, S, 8], 6 bits each
    m = torch.cat([high & 63, (extra >> 4) | ((high >> 2) & 48)], dim=-1)
    scales = (d[..., None] * sc.to(torch.float32)).reshape(out_features, -1)  # [out, in/32]
    offsets = -(dmin[..., None] * m.to(torch.float32)).reshape(out_features, -1)
    nibbles = raw[..., 16:].reshape(out_features, -1, 4, 32)  # [out, S, chunk j, 32 bytes]
    codes = torch.stack([nibbles & 0xF, nibbles >> 4], dim=3).reshape(out_features, -1)  # sub-block 2j + h
    return codes, scales, torch.zeros(scales.shape, dtype=torch.uint8), offsets


def row_order(processor, gguf_name: str, out_features: int, in_features: int) -> tuple[np.ndarray | None, str | None]:
    """(the row order transformers' processor gives tensor `gguf_name`, None for identity; why it is not a row
    permutation, or None). Found by running the processor on probe[r, c] = r * in + c, exact in float64.
    Callers probing a large tensor may pass a smaller `in_features` (the processors transform whole rows: a
    reshape of dim 0 or an elementwise change, which a narrow probe shows as well)."""
    probe = np.arange(out_features * in_features, dtype=np.float64).reshape(out_features, in_features)
    try:
        result = processor.process(weights=probe.copy(), name=gguf_name, tensor_key_mapping={},
                                   parsed_parameters={"tensors": {}})
    except Exception as exc:  # a processor written for real weights may choke on a probe
        return None, f"the {type(processor).__name__} transform could not be probed ({type(exc).__name__}: {exc})"
    out = np.asarray(result.weights)
    if result.name != gguf_name or out.shape != probe.shape:
        return None, f"the {type(processor).__name__} transform renames or reshapes it"
    rows, cols = np.divmod(out, in_features)
    if not (np.array_equal(cols, probe % in_features) and (rows == rows[:, :1]).all()):
        return None, f"the {type(processor).__name__} transform is not a permutation of whole rows"
    order = rows[:, 0].astype(np.int64)
    if not np.array_equal(np.sort(order), np.arange(out_features)):
        return None, f"the {type(processor).__name__} transform is not a permutation of whole rows"
    return (None if np.array_equal(order, np.arange(out_features)) else order), None


def unmappable_architecture(architecture: str) -> str | None:
    """Why the blocks of this architecture are never used directly, or None."""
    from transformers.integrations.gguf.utils import is_gguf_arch_supported

    if is_gguf_arch_supported(architecture):  # transformers' newer loader: its own conversions, maybe packed layers
        return f"transformers loads {architecture!r} GGUFs through its packed loader, not mapped here"
    return None


def _processor_config(model) -> dict:
    return processor_config(model.config)


def processor_config(config) -> dict:
    """What the legacy loader's processors read from its parsed config (llama: head counts)."""
    config = config.get_text_config()
    return {key: getattr(config, key) for key in ("num_attention_heads", "num_key_value_heads", "hidden_size",
                                                  "num_hidden_layers", "model_type") if hasattr(config, key)}


def _field(reader, key: str) -> str:
    field = reader.fields[key]
    return bytes(field.parts[field.data[0]]).decode()
