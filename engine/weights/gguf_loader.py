"""A GGUF file loaded straight into its final form, one tensor at a time: the float model is never built.

The architecture is built from its config with its parameters on the meta device (no memory; buffers that the
file does not hold, such as RoPE's inv_freq, are computed by the modules themselves on the host from the
config, as transformers' own loader computes them, and moved with the model). Each parameter is then filled
from the memory-mapped file (engine.weights.gguf_file) in the form it will be held in, and a decoder layer's linear is
replaced by its int4 or int8 layer as it is read. Names and per-architecture transforms are transformers' own
(`get_gguf_hf_weights_map`, `TENSOR_PROCESSORS`); llama's q/k row permutation is applied to codes as a row
order (engine.weights.gguf_int4.row_order).

Per GGUF type of a decoder linear, with weights="int4":
- where the block kernel runs (engine.weights.gguf_blocks: the CPU, with a C compiler), with kernel "auto" or
  "gguf_blocks": every block type (auto_block_types) as the file's blocks as they are, a
  BlockLinear (no rounding at all at load; the kernel rounds activations to int8 per block, as llama.cpp does).
  Under such layers the head and the table take the same form when their tensor is one of these types
  (head="auto"; a Q4_1 file's Q8_0 table stays with engine.weights.head's rule, int8 rows, beside its int4 layers).
Elsewhere (another kernel asked for, a GPU, no compiler, the other types):
- Q4_0, Q4_1, Q4_K: the file's 4-bit codes as they are, Int4Linear group 32 (engine.weights.gguf_int4). The reference
  path reproduces gguf's dequantization bit for bit; the int4pack kernels hold each group's scale and offset in
  bfloat16, so d (Q4_0 / Q4_1), d * sc (Q4_K) and the offsets are rounded to bfloat16 there.
- Q5_0, Q5_1, Q5_K, Q6_K, Q8_0 (more bits than an int4 code holds): int8 rows (engine.weights.head.Int8Linear, a
  scale per row from the dequantized weight: a second rounding, to half a step, and the kernel's bfloat16 scale)
  where the int8 kernel runs (the CPU), else the dequantized weight in the compute dtype.
- F32, F16, BF16: round-to-nearest int4 at `group_size` (engine.weights.int4.quantize_rtn), tensor by tensor.
With weights="float" every tensor is gguf's dequantized value in the compute dtype. Norms and biases are always
float. The output head and the input table follow engine.weights.head's rules (head="auto": int8 rows for both under
quantized decoder layers where the int8 kernel runs, else float), built from the file's tensor a slice of rows
at a time; int4 ones take the file's codes when the tensor is Q4_0 / Q4_1 / Q4_K, else RTN at `group_size`.

What was loaded in which form is `model.gguf_tensors` ({"Q4_K->int4": {"tensors", "file_bytes", "bytes"}}),
which engine.weights.weights_report shows. A file that disagrees with its config (a missing tensor, a shape,
a type no path reads, a 1-D tensor of a block type) is a GGUFFormatError naming the tensor, raised before anything
is allocated for it. Every tensor's bytes are read through engine.weights.gguf_file.read_rows, which refuses a
non-finite fp16 scale or float value (a NaN in one block is a model answering NaN logits) and a file cut short.

Over 400 lines: one loader, every tensor type's form in one place (the reason a type lands where it does sits beside
it)."""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from typing import Callable

import torch
from torch import nn

from ..config import HEAD_CHOICES
from . import gguf_blocks
from .gguf_blocks import BLOCK_TYPES, BlockEmbedding, BlockLinear
from .gguf_file import GGUFFile, GGUFFormatError, TensorRecord, read_rows, row_layout
from .gguf_int4 import INT4_TYPES, memoized_name_maps, processor_config, row_order, unmappable_architecture
from .gguf_tensors import float_weight, int4_codes, int8_rows, rtn_rows
from .head import (
    Int4Embedding,
    Int8Embedding,
    Int8Linear,
    auto_head_for,
    pick_int8_kernel,
    quantize_rows_int8,
)
from .huge_pages import HugePageArena
from .int4 import Int4Linear, decoder_linears, pick_kernel, quantize_rtn, replace_module, shape_problem

log = logging.getLogger(__name__)

ROW_TYPES = ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")  # more than 4 bits a weight: int8 rows or float
# The types whose other form would be a second rounding into wider int8 rows (and Q4_K): a 5-8-bit file made mostly
# of them loads as int4-class weights under weights="auto" where the block kernel runs (engine.weights.loader).
# Which types kernel="auto" keeps as blocks is auto_block_types (every one).
AUTO_BLOCK_TYPES = ("Q4_K", "Q6_K", "Q8_0")


def auto_block_types() -> tuple[str, ...]:
    """What kernel "auto" keeps as blocks where the block kernel runs: every block type. Q4_0 / Q4_1 stayed on
    torch's int4 kernel on AVX-512 CPUs until the block kernel prefetched its weight stream; since, its decode is
    twice torch's there (the embedded Q4_1 model on a 2-core Xeon: 105 against 50 tok/s at 128 tokens, 77 against
    41 at 1k; `python -m bench decode`), while torch's bfloat16 GEMM still prefills those files faster (348 against
    260 tok/s): decode is what a chat waits on, and reuse spares most prefills."""
    return tuple(BLOCK_TYPES)


FLOAT_TYPES = ("F32", "F16", "BF16")
SUPPORTED_TYPES = INT4_TYPES + ROW_TYPES + FLOAT_TYPES
PROBE_COLUMNS = 2  # columns of the row-order probe (engine.weights.gguf_int4.row_order): the transforms act on rows
LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")
# progress(done, total, what): called after each decoder layer and after the head, table and norms
Progress = Callable[[int, int, str], None]


def unsupported(file: GGUFFile) -> str | None:
    """Why this loader cannot read the file (transformers then loads it its own way), or None."""
    reason = unmappable_architecture(file.architecture)
    if reason is not None:
        return reason
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    if file.architecture not in GGUF_SUPPORTED_ARCHITECTURES:
        return f"transformers has no GGUF mapping for architecture {file.architecture!r}"
    return None


def auto_weights(file: GGUFFile) -> str:
    """What weights="auto" becomes for this file: "int4" when most of its decoder layers' weights (by count)
    are 4-bit codes (Q4_0 / Q4_1 / Q4_K: a 4-bit file loads 4-bit), else "float"."""
    counts: dict[bool, int] = defaultdict(int)
    for record in file.tensors.values():
        if record.name.startswith("blk.") and len(record.shape) == 2:
            counts[record.type_name in INT4_TYPES] += record.num_elements
    return "int4" if counts[True] > counts[False] else "float"


def load_gguf_model(file: GGUFFile, config, device: torch.device, dtype: torch.dtype, *, weights: str = "int4",
                    group_size: int = 128, kernel: str = "auto", head: str = "auto", progress: Progress | None = None,
                    cache_dir=None):
    """The model of `file` (whose checked transformers config is `config`) in eval mode on `device`, each tensor
    in its final form (the module docstring). `weights` "int4" | "float"; `group_size` for what is quantized
    at load; `kernel` the matmul path: "gguf_blocks" (engine.weights.gguf_blocks, every type it holds), one of
    engine.weights.int4's, or "auto" (auto_block_types as blocks where the block kernel runs, the fastest int4 kernel
    for the rest); `head` one of engine.weights.head.HEAD_CHOICES. `progress` (done, total, what) after each decoder
    layer and once more when the head and table are in place; each
    converted tensor is on `device` before the next is read, so on CUDA the host holds one tensor at a time.
    `cache_dir`: the engine's cache folder, where the block kernel is built (engine.weights.gguf_blocks.kernel_dir)."""
    assert weights in ("int4", "float") and head in HEAD_CHOICES, (weights, head)
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    processor = TENSOR_PROCESSORS.get(file.architecture, TensorProcessor)(config=processor_config(config))
    model = meta_model(config, dtype)
    records = _records_by_parameter(file, model, processor)
    loader = _Loader(file, processor, device, dtype, group_size, kernel, cache_dir)
    report = progress or (lambda done, total, what: None)
    linears = decoder_linears(model)
    layers = sorted({int(m.group(1)) for name, _ in linears if (m := LAYER_INDEX.search(f".{name}"))})
    total = len(layers) + 1
    for index, (name, linear) in enumerate(linears):
        weight, bias = records.pop(f"{name}.weight"), records.pop(f"{name}.bias", None)
        replace_module(model, name, loader.linear(linear, weight, bias, quantize=weights == "int4"))
        here = LAYER_INDEX.search(f".{name}")
        after = LAYER_INDEX.search(f".{linears[index + 1][0]}") if index + 1 < len(linears) else None
        if here is not None and (after is None or after.group(1) != here.group(1)):
            done = layers.index(int(here.group(1))) + 1
            release_freed_memory()  # a layer's transients, or they pile up in the heap (0.5 GB over a 7B)
            report(done, total, f"layer {done} of {len(layers)}")
    quantized = any(isinstance(m, (Int4Linear, Int8Linear, BlockLinear)) for m in model.modules())
    # blocks under block layers (one rounding of activations throughout), else engine.weights.head's rule
    if head == "auto":
        under_blocks = any(isinstance(m, BlockLinear) for m in model.modules())
        head = "blocks" if under_blocks and _head_source(model, records).type_name in loader.block_types \
            else auto_head_for(quantized, device)
    _place_head_and_table(model, loader, records, head)
    for hf_name, record in records.items():  # norms, biases outside the linears, anything else: float
        loader.set_float(model, hf_name, record)
    left = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta]
    assert not left, f"parameters without a tensor after the checks: {left[:5]}"
    model.to(device)  # the buffers computed on the host (inv_freq); everything else is there already
    model.eval()
    model.gguf_tensors = {label: dict(entry) for label, entry in sorted(loader.mix.items())}
    release_freed_memory()
    report(total, total, "output head and embeddings")
    return model


def release_freed_memory() -> None:
    """Hand the heap pages the load's transients freed back to the OS. glibc keeps freed blocks below its mmap
    threshold (which grows with each large block freed) in the heap: after loading the embedded model 236 MB of
    a 611 MB anonymous RSS were such free pages. Does nothing where the C library is not glibc."""
    import ctypes

    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def meta_model(config, dtype: torch.dtype):
    """The architecture of `config` with every parameter on the meta device (nothing allocated, not even for a
    moment) and its buffers computed on the host (materialize_buffers); a tied head shares the table's."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.tie_weights()  # from_config has tied a tied head already; the loader relies on it, so it is made sure
    materialize_buffers(model)
    return model.requires_grad_(False)


def materialize_buffers(model) -> None:
    """The buffers a checkpoint does not hold (RoPE's inv_freq, a scaled embedding's scale), computed on the
    host by the model's own initialisation, as transformers' from_pretrained computes them for the model it
    builds on meta (its `_init_weights` per module). Run while the parameters are still on meta, where
    initialising them does nothing."""
    for module in model.modules():
        meta = [name for name, b in module.named_buffers(recurse=False) if b is not None and b.is_meta]
        for name in meta:
            module._buffers[name] = torch.empty_like(module._buffers[name], device="cpu")
        if meta:
            model._init_weights(module)


def _records_by_parameter(file: GGUFFile, model, processor) -> dict[str, TensorRecord]:
    """hf parameter name -> the file's tensor for it, each checked (present, a type this loader reads, the
    parameter's shape); a tied head is left out (it shares the table's tensor)."""
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    with memoized_name_maps():
        gguf_names = get_gguf_hf_weights_map(model, processor)  # gguf name -> hf name
    hf_to_gguf = {hf: gg for gg, hf in gguf_names.items()}
    records: dict[str, TensorRecord] = {}
    missing = []
    for hf_name, param in model.named_parameters():  # tied parameters once, under the table's name
        gguf_name = hf_to_gguf.get(hf_name)
        record = file.tensors.get(gguf_name) if gguf_name is not None else None
        if record is None:
            missing.append(f"{gguf_name or '?'} ({hf_name})")
            continue
        if record.type_name not in SUPPORTED_TYPES:
            raise GGUFFormatError(f"tensor {record.name!r} is {record.type_name}, which this loader does not read "
                                  f"(it reads {', '.join(SUPPORTED_TYPES)})")
        if len(record.shape) == 1 and record.type_name not in FLOAT_TYPES:
            raise GGUFFormatError(f"tensor {record.name!r} is {record.type_name}, but it is 1-D (a norm or a bias), "
                                  f"which converters and quantizers always store as float: its type is not the one "
                                  f"it was written with")
        if tuple(record.shape) != tuple(param.shape):
            raise GGUFFormatError(f"tensor {record.name!r} has shape {list(record.shape)}, but the config makes "
                                  f"{hf_name} {list(param.shape)}")
        records[hf_name] = record
    if missing:
        raise GGUFFormatError(f"the file lacks {len(missing)} tensor(s) the config needs: {', '.join(missing[:6])}"
                              f"{' ...' if len(missing) > 6 else ''}")
    unused = sorted(set(file.tensors) - {r.name for r in records.values()})
    if unused:
        log.info("GGUF tensors no parameter reads: %s", ", ".join(unused[:10]))
    return records


class _Loader:
    """What one load decided (device, dtype, kernels), and the tally of what each tensor became."""

    def __init__(self, file: GGUFFile, processor, device: torch.device, dtype: torch.dtype, group_size: int,
                 kernel: str, cache_dir=None):
        self.file, self.processor, self.device, self.dtype, self.group_size = file, processor, device, dtype, group_size
        # The block kernel for the types it holds, where it runs ("auto") or as asked; the int4 kernel for the rest
        # ("auto" then), picked at the first int4 layer.
        self.block_types: tuple[str, ...] = ()
        if kernel in ("auto", gguf_blocks.KERNEL):
            why = gguf_blocks.unavailable(device, cache_dir)
            if why is not None and kernel == gguf_blocks.KERNEL:
                raise ValueError(f"kernel {gguf_blocks.KERNEL!r} is unavailable: {why}")
            if why is not None:
                log.info("GGUF blocks through the int4 / int8 kernels: %s", why)
            else:
                self.block_types = tuple(BLOCK_TYPES) if kernel == gguf_blocks.KERNEL else auto_block_types()
            kernel = "auto"
        self.kernel = kernel
        self._int4: tuple[str, str | None] | None = None
        # 5/6/8-bit tensors become int8 rows only where the int8 kernel runs; elsewhere the reference int8 path
        # would dequantize the whole weight at every step, so they stay float.
        self.int8 = pick_int8_kernel(device)[0] == "cpu_int8pack"
        self.mix: dict[str, dict[str, int]] = defaultdict(lambda: {"tensors": 0, "file_bytes": 0, "bytes": 0})
        self.arena = HugePageArena()  # the blocks' bytes: read whole at every decode step (huge_pages.py)

    def count(self, record: TensorRecord, form: str, tensors) -> None:
        entry = self.mix[f"{record.type_name}->{form}"]
        entry["tensors"] += 1
        entry["file_bytes"] += record.nbytes
        entry["bytes"] += sum(t.numel() * t.element_size() for t in tensors)

    def int4_kernel(self) -> tuple[str, str | None]:
        if self._int4 is None:
            self._int4 = pick_kernel(self.kernel, self.device)
        return self._int4

    def row_order(self, record: TensorRecord):
        """The processor's row order for a 2-D tensor (None: identity), or False when it is not one."""
        order, why = row_order(self.processor, record.name, record.shape[0], min(record.shape[1], PROBE_COLUMNS))
        if why is not None:
            log.info("GGUF %s: through its float value (%s)", record.name, why)
            return False
        return order

    def float32(self, record: TensorRecord) -> torch.Tensor:
        return float_weight(self.file, record, self.processor)

    def float_tensor(self, record: TensorRecord) -> torch.Tensor:
        return self.float32(record).to(self.dtype).to(self.device)

    def set_float(self, model, hf_name: str, record: TensorRecord) -> nn.Parameter:
        value = nn.Parameter(self.float_tensor(record), requires_grad=False)
        parent, _, leaf = hf_name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, value)
        self.count(record, _dtype_name(self.dtype), [value])
        return value

    def int8_rows(self, record: TensorRecord, order) -> tuple[torch.Tensor, torch.Tensor]:
        if order is False:
            return quantize_rows_int8(self.float32(record))
        return int8_rows(self.file, record, order)

    def rtn_rows(self, record: TensorRecord, order):
        if order is False:
            return quantize_rtn(self.float32(record), self.group_size)
        return rtn_rows(self.file, record, order, self.group_size)

    def block_rows(self, record: TensorRecord, order) -> torch.Tensor:
        """The file's bytes of `record`, uint8 [rows, row bytes], rows in `order` (None: as stored), read straight
        into the tensor that keeps them (not through a memory map, whose pages would count in the process's
        memory next to the copy: the load holds the kept bytes and nothing of the file beside them), which lies
        in memory advised for huge pages (huge_pages.py: a decode step reads it whole). Checked as it is read
        (gguf_file.read_rows: finite scales, the file not cut short), in the file's row order, so a message names
        the row as the file stores it."""
        try:
            row_bytes = gguf_blocks.row_bytes(record.type_name, record.shape[-1])
        except ValueError as exc:
            raise GGUFFormatError(f"tensor {record.name!r}: {exc}") from None
        rows = record.nbytes // row_bytes
        if rows * row_bytes != record.nbytes:
            raise GGUFFormatError(f"tensor {record.name!r}: {record.nbytes} bytes are not rows of {row_bytes}")
        kept = self.arena.empty(rows, row_bytes)
        held = kept if order is None else torch.empty(rows, row_bytes, dtype=torch.uint8)
        if row_layout(record) != (rows, row_bytes):
            raise GGUFFormatError(f"tensor {record.name!r}: {rows} rows of {row_bytes} bytes for the block kernel, "
                                  f"{row_layout(record)} as stored")
        read_rows(self.file, record, out=held.numpy())
        return held if order is None else torch.index_select(held, 0, torch.from_numpy(order), out=kept)

    def block_linear(self, record: TensorRecord, bias) -> BlockLinear | None:
        """`record` as a BlockLinear when the load keeps its type as blocks and its transform is a row order."""
        if record.type_name not in self.block_types:
            return None
        order = self.row_order(record)
        if order is False:
            return None
        layer = BlockLinear(self.block_rows(record, order), record.type_name, record.shape[1], bias, take=True)
        self.count(record, "blocks", [layer.blocks])
        return layer

    def linear(self, meta: nn.Linear, weight: TensorRecord, bias: TensorRecord | None, quantize: bool) -> nn.Module:
        """The decoder linear of `weight` (and `bias`) in its final form."""
        bias_value = self.float_tensor(bias) if bias is not None else None
        if bias is not None:
            self.count(bias, _dtype_name(self.dtype), [bias_value])
        held = self.block_linear(weight, bias_value) if quantize else None
        if held is not None:
            return held
        if quantize and (weight.type_name not in ROW_TYPES or self.int8):
            order = self.row_order(weight)
            if weight.type_name in ROW_TYPES:
                codes, scales = self.int8_rows(weight, order)
                layer = Int8Linear(codes.to(self.device), scales.to(self.device), bias_value, "cpu_int8pack")
                self.count(weight, "int8", layer.buffers())
                return layer
            if weight.type_name in INT4_TYPES and order is not False:
                origin = f"gguf-{weight.type_name.lower()}"
                return self.int4(weight, int4_codes(self.file, weight, order), bias_value, origin)
            return self.int4(weight, (*self.rtn_rows(weight, order), None), bias_value, "rtn")
        dense = nn.Linear(meta.in_features, meta.out_features, bias=bias is not None, device="meta")
        dense.weight = nn.Parameter(self.float_tensor(weight), requires_grad=False)
        if bias_value is not None:
            dense.bias = nn.Parameter(bias_value, requires_grad=False)
        self.count(weight, _dtype_name(self.dtype), [dense.weight])
        return dense

    def int4(self, record: TensorRecord, canonical, bias, origin: str) -> Int4Linear:
        """An Int4Linear of canonical (codes, scales, zeros, offsets) on the load's int4 kernel (the reference
        path where the kernel cannot take its shape)."""
        codes, scales, zeros, offsets = canonical
        kernel, reason = self.int4_kernel()
        problem = shape_problem(kernel, codes.shape[0], codes.shape[1])
        if problem is not None:
            log.info("GGUF %s: int4 reference path (%s)", record.name, problem)
            kernel, reason = "reference", problem
        to = lambda t: None if t is None else t.to(self.device)  # noqa: E731
        layer = Int4Linear.from_codes(to(codes), to(scales), to(zeros), record.shape[1], bias, kernel, origin=origin,
                                      offsets=to(offsets))
        layer.fallback_reason = reason
        self.count(record, "int4", layer.buffers())
        return layer

    def int4_canonical(self, record: TensorRecord, order):
        """((codes, scales, zeros, offsets), origin) of a head or table: the file's own codes when it is
        Q4_0 / Q4_1 / Q4_K, else RTN at the load's group size."""
        if record.type_name in INT4_TYPES and order is not False:
            return int4_codes(self.file, record, order), f"gguf-{record.type_name.lower()}"
        return (*self.rtn_rows(record, order), None), "rtn"


def _head_source(model, records: dict[str, TensorRecord]) -> TensorRecord:
    """The tensor the output head is read from: the table's when they are tied."""
    output, inputs = model.get_output_embeddings(), model.get_input_embeddings()
    names = {id(m): n for n, m in model.named_modules()}
    own = records.get(f"{names[id(output)]}.weight")
    return records[f"{names[id(inputs)]}.weight"] if output.weight is inputs.weight or own is None else own


def _place_head_and_table(model, loader: _Loader, records: dict[str, TensorRecord], head: str) -> None:
    """Fill the input table and the output head in `head` format (engine.weights.head.HEAD_FORMATS, or "blocks":
    the file's blocks for the block kernel) from their tensors, as engine.weights.head.quantize_head would make them
    from the float model; a tied head shares the table's float Parameter, or with "+embedding" (and "blocks") the table
    holds the head's own codes."""
    output, inputs = model.get_output_embeddings(), model.get_input_embeddings()
    names = {id(m): n for n, m in model.named_modules()}
    table_name, head_name = f"{names[id(inputs)]}.weight", f"{names[id(output)]}.weight"
    tied = output.weight is inputs.weight
    table, own = records.pop(table_name), records.pop(head_name, None)
    if head != "float" and not isinstance(output, nn.Linear):
        raise ValueError(f"the output head of {type(model).__name__} is a {type(output).__name__}, not an nn.Linear")
    if head == "blocks":
        _place_blocks(model, loader, names[id(output)], table, None if tied else own)
        return
    if head == "float":
        table_value = loader.set_float(model, table_name, table)
        if tied:
            output.weight = table_value
        else:
            loader.set_float(model, head_name, own)
        return
    source = table if tied else own
    order = loader.row_order(source)
    if head.startswith("int8"):
        path, reason = pick_int8_kernel(loader.device)
        codes, scales = loader.int8_rows(source, order)
        new_head = Int8Linear(codes.to(loader.device), scales.to(loader.device), None, path)
        loader.count(source, "int8", new_head.buffers())
    else:
        canonical, origin = loader.int4_canonical(source, order)
        new_head = loader.int4(source, canonical, None, origin)
        reason = new_head.fallback_reason
    new_head.fallback_reason = reason
    replace_module(model, names[id(output)], new_head)
    model.config.tie_word_embeddings = False  # the head no longer shares a Parameter with the table
    if not head.endswith("+embedding"):
        loader.set_float(model, table_name, table)
        return
    device, embed_scale = loader.device, getattr(inputs, "embed_scale", None)  # Gemma's scaled table
    if isinstance(new_head, Int8Linear):
        if tied:  # the head's codes, held once
            new_table = Int8Embedding(new_head.codes, new_head.scales, loader.dtype, embed_scale)
        else:
            codes, scales = loader.int8_rows(table, loader.row_order(table))
            new_table = Int8Embedding(codes.to(device), scales.to(device), loader.dtype, embed_scale)
            loader.count(table, "int8", new_table.buffers())
    else:
        if not tied:
            canonical, origin = loader.int4_canonical(table, loader.row_order(table))
        codes, scales, zeros, offsets = (t if t is None else t.to(device) for t in canonical)
        new_table = Int4Embedding(codes, scales, zeros, table.shape[1], loader.dtype, origin=origin, offsets=offsets,
                                  embed_scale=embed_scale)
        if not tied:
            loader.count(table, "int4", new_table.buffers())
    model.set_input_embeddings(new_table)


def _place_blocks(model, loader: _Loader, head_name: str, table: TensorRecord, own: TensorRecord | None) -> None:
    """The head from its tensor's blocks (`own`, or the table's when tied: None), and the table from its blocks
    (the head's own, held once, when tied) or in float when the block kernel does not hold its type."""
    inputs = model.get_input_embeddings()
    new_head = loader.block_linear(own or table, None)
    assert new_head is not None, (own or table).name
    replace_module(model, head_name, new_head)
    model.config.tie_word_embeddings = False  # the head no longer shares a Parameter with the table
    embed_scale = getattr(inputs, "embed_scale", None)  # Gemma's scaled table
    tiled = False
    if own is None:
        blocks, tiled = new_head.blocks, new_head.tiled
    elif table.type_name in loader.block_types and loader.row_order(table) is None:
        blocks = loader.block_rows(table, None)
        loader.count(table, "blocks", [blocks])
    else:
        names = {id(m): n for n, m in model.named_modules()}
        loader.set_float(model, f"{names[id(inputs)]}.weight", table)
        return
    model.set_input_embeddings(BlockEmbedding(blocks, table.type_name, table.shape[1], loader.dtype, embed_scale,
                                              tiled))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
