"""One GGUF tensor, read from the file, in the form a layer holds: float, int8 rows or int4 groups.

Values are gguf-py's own dequantization (`gguf.quants.dequantize`, float32), the one transformers' GGUF loader
uses, so a float tensor here equals the one transformers would load, bit for bit, after the same architecture
transform (its TensorProcessor: llama's q/k row permutation, Gemma's norm offset). Where the transform is a
permutation of whole rows (`row_order`), the rows are taken from the file in that order instead, which lets a
large tensor be converted a slice of rows at a time: int8 rows and int4 groups are per row, so a slice gives
the same codes as the whole, and only CHUNK_ELEMENTS values (a few rows of the widest matrix) are ever held in
float, whatever the model's size.

Roundings, per form:
- float: none beyond the cast of gguf's float32 value to the compute dtype.
- int8 rows (`int8_rows`): a second rounding of the dequantized weight, one float32 scale per row
  (|w - q * scale| <= scale / 2, scale = max |w| / 127 of the row); the cpu_int8pack kernel then holds the scale
  in bfloat16 (engine.weights.head.Int8Linear), a factor within 2^-8 of 1 on the whole row.
- int4 codes (`int4_codes`, Q4_0 / Q4_1 / Q4_K): none; the codes are the file's (engine.weights.gguf_int4).
- int4 RTN (`rtn_rows`): a second rounding, round-to-nearest per group (engine.weights.int4.quantize_rtn).

Every byte is read through engine.weights.gguf_file.read_rows, which refuses a non-finite scale or float value
and a file cut short, before any of it is converted.
"""

from __future__ import annotations

import numpy as np
import torch

from .gguf_file import GGUFFile, TensorRecord, read_rows, row_layout
from .gguf_int4 import decode_blocks
from .head import quantize_rows_int8
from .int4 import padded_features, quantize_rtn

# Values dequantized at a time when a tensor is converted to int8 rows or int4 groups: 16 MB of float32, so the
# float slice and its conversion's temporaries stay well under a layer's own size at 7B (a 4096-row slice of a
# 14336-wide matrix was 235 MB of float32 and ~1 GB with the dequantizer's temporaries).
CHUNK_ELEMENTS = 1 << 22


def dequantized(file: GGUFFile, record: TensorRecord, rows=None) -> np.ndarray:
    """float32 values of `record` ([rows, columns]; a 1-D tensor as [1, n]), gguf-py's dequantization (Q6_K and
    Q8_0, the 5-8-bit types of the common files, by the same float32 products in torch: dequantize_q6_k,
    dequantize_q8_0); `rows` (a slice or an index array) reads only those rows of the file."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    data = stored_rows(file, record, rows)
    fast = _TORCH_DEQUANTIZE.get(record.type_name)
    if fast is not None:
        return fast(data).numpy()
    values = dequantize(data, GGMLQuantizationType(record.ggml_type))
    return values if values.flags.writeable else np.array(values)  # gguf may hand back a read-only view


def stored_rows(file: GGUFFile, record: TensorRecord, rows=None) -> np.ndarray:
    """The stored bytes of `record`'s `rows` (None: all; a slice of step 1; an index array), uint8 [rows, row
    bytes], checked (read_rows). An index array reads the span from its smallest row to its largest: llama's q/k
    order permutes rows within a head, so a slice of the order spans about as many rows as it holds."""
    if rows is None:
        return read_rows(file, record)
    if isinstance(rows, slice):
        assert rows.step in (None, 1), rows
        start, stop, _ = rows.indices(row_layout(record)[0])
        return read_rows(file, record, start, stop)
    rows = np.asarray(rows)
    if rows.size == 0:
        return read_rows(file, record, 0, 0)
    low, high = int(rows.min()), int(rows.max()) + 1
    return read_rows(file, record, low, high)[rows - low]


def _fp16_field(blocks: torch.Tensor, start: int) -> torch.Tensor:
    return blocks[:, start:start + 2].contiguous().view(torch.float16)[:, 0].to(torch.float32)


def dequantize_q6_k(data: np.ndarray) -> torch.Tensor:
    """Q6_K bytes [rows, row bytes] -> float32 [rows, columns], each value d * scale (float32) times the signed
    6-bit code, as gguf's `quants.Q6_K.dequantize_blocks` forms it. Block of 256: 128 bytes of low nibbles, 64 of
    high 2-bit pairs, 16 int8 sub-scales, an fp16 d."""
    rows = data.shape[0]
    blocks = torch.from_numpy(np.ascontiguousarray(data)).reshape(-1, 210)  # the bytes read, not shared
    n = blocks.shape[0]
    d = _fp16_field(blocks, 208)[:, None] * blocks[:, 192:208].view(torch.int8).to(torch.float32)  # [n, 16]
    shifts_low = torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)
    low = ((blocks[:, :128].reshape(n, 2, 1, 64) >> shifts_low) & 0x0F).reshape(n, 8, 32)
    shifts_high = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    high = ((blocks[:, 128:192].reshape(n, 2, 1, 32) >> shifts_high) & 0x03).reshape(n, 8, 32)
    q = ((low | (high << 4)).view(torch.int8) - 32).reshape(n, 16, 16).to(torch.float32)
    return (d[:, :, None] * q).reshape(rows, -1)


def dequantize_q8_0(data: np.ndarray) -> torch.Tensor:
    """Q8_0 bytes -> float32, code times the block's fp16 scale (gguf's `quants.Q8_0.dequantize_blocks`)."""
    rows = data.shape[0]
    blocks = torch.from_numpy(np.ascontiguousarray(data)).reshape(-1, 34)
    return (blocks[:, 2:].view(torch.int8).to(torch.float32) * _fp16_field(blocks, 0)[:, None]).reshape(rows, -1)


_TORCH_DEQUANTIZE = {"Q6_K": dequantize_q6_k, "Q8_0": dequantize_q8_0}


def float_weight(file: GGUFFile, record: TensorRecord, processor) -> torch.Tensor:
    """The tensor as transformers' GGUF loader hands it to the model: dequantized, transformed by the
    architecture's processor, float32 (the caller casts it)."""
    values = dequantized(file, record).reshape(record.shape)
    result = processor.process(weights=values, name=record.name, tensor_key_mapping={},
                               parsed_parameters={"tensors": {}})
    assert result.name == record.name, (record.name, result.name)  # renaming processors are refused earlier
    return torch.from_numpy(np.array(result.weights, dtype=np.float32))  # a copy, as transformers takes


def _row_slices(num_rows: int, num_columns: int, order: np.ndarray | None):
    """(start, stop, rows of the file to read) for each slice of about CHUNK_ELEMENTS values of the output."""
    step = max(1, CHUNK_ELEMENTS // max(num_columns, 1))
    for start in range(0, num_rows, step):
        stop = min(start + step, num_rows)
        yield start, stop, slice(start, stop) if order is None else order[start:stop]


def int8_rows(file: GGUFFile, record: TensorRecord, order: np.ndarray | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8 [out, in], scales float32 [out]) of the dequantized rows, output row r from file row
    order[r] (or r), a slice of rows at a time."""
    out_features, in_features = record.shape
    codes = torch.empty(out_features, in_features, dtype=torch.int8)
    scales = torch.empty(out_features, dtype=torch.float32)
    for start, stop, rows in _row_slices(out_features, in_features, order):
        codes[start:stop], scales[start:stop] = quantize_rows_int8(torch.from_numpy(dequantized(file, record, rows)))
    return codes, scales


def rtn_rows(file: GGUFFile, record: TensorRecord, order: np.ndarray | None, group_size: int):
    """(codes uint8 [out, in_padded], scales float32 [out, groups], zeros uint8) of the dequantized rows,
    round-to-nearest per group of `group_size` (engine.weights.int4.quantize_rtn), a slice of rows at a time."""
    out_features, in_features = record.shape
    padded = padded_features(in_features, group_size)
    codes = torch.empty(out_features, padded, dtype=torch.uint8)
    scales = torch.empty(out_features, padded // group_size, dtype=torch.float32)
    zeros = torch.empty(out_features, padded // group_size, dtype=torch.uint8)
    for start, stop, rows in _row_slices(out_features, in_features, order):
        weight = torch.from_numpy(dequantized(file, record, rows))
        codes[start:stop], scales[start:stop], zeros[start:stop] = quantize_rtn(weight, group_size)
    return codes, scales, zeros


def int4_codes(file: GGUFFile, record: TensorRecord, order: np.ndarray | None):
    """The canonical int4 codes of a Q4_0 / Q4_1 / Q4_K tensor as they are (engine.weights.gguf_int4.decode_blocks):
    (codes [out, in], scales [out, in/32], zeros, offsets or None), output row r from file row order[r]."""
    data = stored_rows(file, record)
    return decode_blocks(data if order is None else data[order], record.type_name)
