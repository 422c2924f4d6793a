"""How much memory a model's weights will take in each format, before loading it (Model > Choose model shows it).

The model is built from its config on the meta device (no memory, no weights read), so the count covers every
parameter of any architecture transformers knows; the int4 figure applies the int4 layout of engine.weights.int4 to the
decoder layers' linears (packed codes: half a byte a weight; per group of G inputs, a scale and an offset in
bfloat16 for the fast kernels, a float32 scale and a byte zero for the reference path) and keeps the rest in
the float dtype, as loading with weights="int4" does, with the head and table in int8 where head="auto" puts
them there.
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import loader
from .int4 import DECODER_LINEAR, decoder_linears, padded_features

# Bytes per group per output row: fast kernels keep [scale, offset] in bfloat16; the reference path keeps a
# float32 scale and a uint8 zero.
_GROUP_BYTES = {"fast": 4, "reference": 5}


def _meta_model(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def weight_bytes(config, dtype: torch.dtype, *, group_size: int = 128, fast_kernel: bool = True,
                 int8_head: bool = False) -> dict[str, int]:
    """{"float": bytes of all weights in `dtype`, "int4": bytes with the decoder linears in int4,
    "outside_layers": bytes of the weights outside the decoder layers (embeddings, norms, head: never int4 here,
    always resident when layers stream)} for a model of `config`. Tied embeddings count once (as loaded).
    `int8_head`: the "int4" figure has the output head and the input table in int8 rows (head="auto" where the
    int8 kernel runs: engine.weights.head.auto_head), and so has "outside_layers"."""
    model = _meta_model(config)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    element = torch.empty((), dtype=dtype).element_size()
    params = {id(p): p for p in model.parameters()}
    float_bytes = sum(p.numel() for p in params.values()) * element
    inside = {id(p) for name, p in model.named_parameters() if DECODER_LINEAR.search(name)}
    outside = sum(p.numel() for i, p in params.items() if i not in inside) * element
    int4_saving = 0
    per_group = _GROUP_BYTES["fast" if fast_kernel else "reference"]
    for _name, linear in decoder_linears(model):
        padded = padded_features(linear.in_features, group_size)
        held = linear.out_features * padded // 2 + linear.out_features * (padded // group_size) * per_group
        int4_saving += linear.weight.numel() * element - held
    head_saving = 0
    if int8_head:
        tables = {id(m.weight): m.weight for m in (model.get_input_embeddings(), model.get_output_embeddings())
                  if m is not None and hasattr(m, "weight")}
        # int8 codes, one byte a weight, and a bfloat16 scale per row
        head_saving = sum(t.numel() * element - (t.numel() + 2 * t.shape[0]) for t in tables.values())
    return {"float": float_bytes, "int4": float_bytes - int4_saving - head_saving,
            "outside_layers": outside - head_saving}


def _int4_bytes(out_features: int, in_features: int, group_size: int, fast_kernel: bool, offsets: bool) -> int:
    """Bytes of an Int4Linear (engine.weights.int4): packed codes, and per group of a row a bfloat16 scale and offset
    (fast kernels) or a float32 scale, a uint8 zero and, for codes with their own minimum, a float32 offset."""
    padded = padded_features(in_features, group_size)
    per_group = _GROUP_BYTES["fast"] if fast_kernel else _GROUP_BYTES["reference"] + 4 * offsets
    return out_features * padded // 2 + out_features * (padded // group_size) * per_group


def gguf_weight_bytes(file, dtype: torch.dtype, *, group_size: int = 128, int4_kernel: str = "cpu_int4pack",
                      int8_kernel: bool = True, blocks: tuple[str, ...] = ()) -> dict[str, int]:
    """weight_bytes for a GGUF file, tensor by tensor as engine.weights.gguf_loader keeps it: "float" every tensor in
    `dtype`; "int4" the decoder matrices as weights="int4" loads them: the types in `blocks` (those the load keeps
    as blocks: engine.weights.gguf_loader.AUTO_BLOCK_TYPES where the block kernel runs) at the file's own bytes; other
    4-bit codes as int4 at their own 32-weight groups, 5/6/8-bit ones as int8 rows where the int8 kernel runs and
    in `dtype` where it does not, float ones RTN at `group_size`;
    the table and a tied head once as head="auto" puts them (their blocks, or int8 rows). Reads the header only."""
    from .gguf_int4 import BLOCK, INT4_TYPES
    from .gguf_loader import ROW_TYPES
    from .int4 import shape_problem

    element = torch.empty((), dtype=dtype).element_size()
    records = list(file.tensors.values())
    float_bytes = sum(r.num_elements for r in records) * element
    int4 = outside = 0
    quantized = False
    for record in records:
        matrix = record.name.startswith("blk.") and len(record.shape) == 2
        if not matrix:
            if record.name not in ("token_embd.weight", "output.weight"):
                int4 += record.num_elements * element
                outside += 0 if record.name.startswith("blk.") else record.num_elements * element
            continue
        out_features, in_features = record.shape
        if record.type_name in blocks:
            held = record.nbytes
            quantized = True
        elif record.type_name in ROW_TYPES:
            held = out_features * in_features + 2 * out_features if int8_kernel else record.num_elements * element
            quantized |= int8_kernel
        else:
            fast = int4_kernel != "reference" and shape_problem(int4_kernel, out_features, in_features) is None
            four_bit = record.type_name in INT4_TYPES
            held = _int4_bytes(out_features, in_features, BLOCK if four_bit else group_size, fast,
                               four_bit and record.type_name != "Q4_0")
            quantized = True
        int4 += held
    int8_head = quantized and int8_kernel
    head_source = file.tensors.get("output.weight") or file.tensors.get("token_embd.weight")
    under_blocks = any(r.type_name in blocks for r in records if r.name.startswith("blk.") and len(r.shape) == 2)
    block_head = under_blocks and head_source is not None and head_source.type_name in blocks
    for name in ("token_embd.weight", "output.weight"):
        record = file.tensors.get(name)
        if record is None:
            continue
        rows = record.shape[0]
        if block_head:
            held = record.nbytes if record.type_name in blocks else record.num_elements * element
        else:
            held = record.num_elements + 2 * rows if int8_head else record.num_elements * element
        int4 += held
        outside += held
    return {"float": float_bytes, "int4": int4, "outside_layers": outside}


def estimate(source=None, *, device: str = "auto", dtype: str = "auto", group_size: int = 128) -> dict:
    """What loading `source` (a path, a hub id or None for the embedded model) would hold in weights, per
    format, on `device`: {"float": bytes, "int4": bytes (for a GGUF, its own mix: gguf_weight_bytes), "awq":
    whether it is an AWQ int4 checkpoint (its "float" is what dequantizing it would take), "dtype": the float
    dtype, "auto": {"loads": the format weights="auto" picks, "why"} (engine.weights.loader.resolve_weights)}. Reads the
    config and headers only; raises ModelLoadError when they cannot be read."""
    src = loader.resolve_source(source)
    dev = loader.pick_device(device)
    dt = loader.pick_dtype(dtype, dev)
    config = loader.read_config(src)
    loads, why = loader.resolve_weights(src, dev, dt, "auto")
    quant = getattr(config, "quantization_config", None) or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    awq = str(method).lower() == "awq"
    if awq:
        group_size = int((quant.get("group_size") if isinstance(quant, dict) else quant.group_size) or group_size)
        config = type(config).from_dict({k: v for k, v in config.to_dict().items() if k != "quantization_config"})
    from .head import pick_int8_kernel
    from .int4 import pick_kernel

    kernel, why_not = pick_kernel("auto", dev)
    fast = why_not is None
    int8 = pick_int8_kernel(dev)[1] is None
    if src.kind == "gguf":
        from .gguf_blocks import expected_unavailable
        from .gguf_file import read_gguf
        from .gguf_loader import auto_block_types

        sizes = gguf_weight_bytes(read_gguf(Path(src.location) / src.gguf_file), dt, group_size=group_size,
                                  int4_kernel=kernel if fast else "reference", int8_kernel=int8,
                                  blocks=auto_block_types() if expected_unavailable(dev) is None else ())
    else:
        sizes = weight_bytes(config, dt, group_size=group_size, fast_kernel=fast, int8_head=int8)
    return {**sizes, "awq": awq, "dtype": str(dt).replace("torch.", ""), "group_size": group_size,
            "auto": {"loads": loads, "why": why}}
