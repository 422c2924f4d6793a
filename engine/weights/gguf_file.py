"""Reading a GGUF file's header into plain records, every count, length and offset checked against the file.

A GGUF file is outside input: its header says how many metadata values and tensors follow, how long each string
and array is, and where each tensor's bytes lie. gguf-py's reader trusts those numbers (an array of 2**60 one-byte
items keeps it looping past the end of the file for good), so a file is walked here first, with nothing allocated
from a number before that number is checked against the bytes that are actually there:

    magic "GGUF", version (2 or 3), tensor count (u64), metadata count (u64)
    metadata: key (u64 length + bytes), value type (u32), value (scalar, string, or array: type, u64 count, items)
    tensor infos: name, n_dims (u32, 1..4), dims (u64 each, fastest-moving first), ggml type (u32), offset (u64)
    padding to general.alignment (32 unless stated), then the tensor data; each offset is from there

A problem is a GGUFFormatError naming the key or tensor and the numbers. Tensor bytes are read by `read_rows`,
which checks what the header cannot: that every fp16 scale of every block, and every value of a float tensor, is
finite (a NaN there is a model that answers NaN logits, however well-formed the file).

Nothing here reads the file through a memory mapping. A mapped page whose bytes are gone (the file was cut
short after it was mapped: overwritten, or still being copied) kills the process with SIGBUS, which Python cannot
catch; a file read there is a short read, and a GGUFFormatError saying at which byte the file ended.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 2  # arrays of arrays are legal; deeper nesting is not written by any converter
# Value types (gguf spec) -> struct format of a scalar.
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
# The fewest bytes one entry can take, for bounding counts: a key or name (u64 length) + type (u32) + 1 byte;
# a tensor info: name length + n_dims + type + offset.
MIN_ITEM_BYTES = {STRING: 8, ARRAY: 12}
MIN_METADATA_BYTES = 8 + 4 + 1
MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8
HEADER_CHUNK = 1 << 20  # the header is read in pieces of this size, as far as the parse has got
# Said wherever the file holds fewer bytes than its header describes: the usual cause is a copy or download that
# has not finished, or a file overwritten while it was read.
CUT_SHORT = "it may be incomplete or still being copied"
# Where a block type keeps its fp16 scales (ggml's block structs): type -> ((field, byte in the block), ...).
# Q8_K (float32 d) and the IQ types are left out: no converter writes the first, and no loader here reads the rest.
SCALE_FIELDS = {
    "Q4_0": (("d", 0),), "Q4_1": (("d", 0), ("m", 2)), "Q5_0": (("d", 0),), "Q5_1": (("d", 0), ("m", 2)),
    "Q8_0": (("d", 0),), "Q2_K": (("d", 80), ("dmin", 82)), "Q3_K": (("d", 108),),
    "Q4_K": (("d", 0), ("dmin", 2)), "Q5_K": (("d", 0), ("dmin", 2)), "Q6_K": (("d", 208),),
}
# Float types -> (element type of its bits, exponent mask): all exponent bits set is an infinity or a NaN.
FLOAT_BITS = {"F16": ("<u2", 0x7C00), "BF16": ("<u2", 0x7F80), "F32": ("<u4", 0x7F800000)}
FP16_EXPONENT = 0x7C00


class GGUFFormatError(ValueError):
    """A file that is not a well-formed GGUF; the message says where and with which values."""


@dataclass(frozen=True)
class TensorRecord:
    """Where one tensor lies in the file and how it is stored. `shape` in torch order (a matrix: [rows, columns],
    the reverse of GGML's dims); `offset` from the start of the file."""

    name: str
    type_name: str  # "Q4_K", "F32", ...; "type 99" for an id gguf-py does not know
    ggml_type: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def num_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class GGUFFile:
    path: str
    size: int
    version: int
    metadata: dict = field(repr=False)  # key -> int | float | bool | str | list
    tensors: dict = field(repr=False)  # name -> TensorRecord, in file order
    data_start: int
    metadata_end: int  # the metadata section is bytes [0, metadata_end)
    metadata_digest: str  # blake2b of the metadata bytes and the file size: the tokenizer cache key

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


class _Cursor:
    """Reads little-endian values from the start of an open file, refusing any read past `end` (the file's size
    when opened). The bytes read so far are `buffer` (bytes [0, len(buffer)) of the file), filled from the file
    as the parse needs them; a file that has become shorter since it was opened is a GGUFFormatError there."""

    def __init__(self, handle, end: int):
        self.handle, self.end, self.pos = handle, end, 0
        self.buffer = bytearray()

    def left(self) -> int:
        return self.end - self.pos

    def need(self, nbytes: int, what: str) -> None:
        if nbytes > self.left():
            raise GGUFFormatError(f"{what} needs {nbytes} bytes at offset {self.pos}, but the file ends "
                                  f"{self.left()} bytes later: {CUT_SHORT}")
        while len(self.buffer) < self.pos + nbytes:
            want = min(max(self.pos + nbytes - len(self.buffer), HEADER_CHUNK), self.end - len(self.buffer))
            got = self.handle.read(want)
            if not got:
                now = os.fstat(self.handle.fileno()).st_size
                raise GGUFFormatError(f"the file ended at byte {now} while reading the header ({what}), "
                                      f"{self.end} bytes when it was opened: {CUT_SHORT}")
            self.buffer += got

    def scalar(self, code: str, what: str):
        width = struct.calcsize("<" + code)
        self.need(width, what)
        (value,) = struct.unpack_from("<" + code, self.buffer, self.pos)
        self.pos += width
        return value

    def scalars(self, code: str, count: int, what: str) -> list:
        width = struct.calcsize("<" + code)
        self.need(count * width, what)
        values = np.frombuffer(self.buffer, dtype=np.dtype("<" + code), count=count, offset=self.pos).tolist()
        self.pos += count * width
        return values

    def string(self, what: str) -> str:
        length = self.scalar("Q", f"the length of {what}")
        self.need(length, f"{what} ({length} bytes)")
        raw = self.buffer[self.pos:self.pos + length]
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise GGUFFormatError(f"{what} at offset {self.pos - length} is not UTF-8: {exc}") from None


def read_gguf(path: str | Path) -> GGUFFile:
    """The header of the GGUF file at `path`, checked (GGUFFormatError otherwise). Reads the header's bytes (and
    at most HEADER_CHUNK beyond), with file reads."""
    path = str(path)
    with open(path, "rb", buffering=0) as handle:
        size = os.fstat(handle.fileno()).st_size
        if size < 24:
            raise GGUFFormatError(f"{path} is {size} bytes: too short for a GGUF header (24 bytes)")
        return _parse(path, _Cursor(handle, size), size)


def _parse(path: str, cursor: _Cursor, size: int) -> GGUFFile:
    cursor.need(4, "the magic bytes")
    magic = bytes(cursor.buffer[:4])
    if magic != b"GGUF":
        raise GGUFFormatError(f"{path} does not start with the GGUF magic bytes (starts with {magic!r})")
    cursor.pos = 4
    version = cursor.scalar("I", "the version")
    if version not in VERSIONS:
        raise GGUFFormatError(f"GGUF version {version} is not readable here (versions {VERSIONS})")
    num_tensors = cursor.scalar("Q", "the tensor count")
    num_values = cursor.scalar("Q", "the metadata count")
    if num_values * MIN_METADATA_BYTES > cursor.left():
        raise GGUFFormatError(f"the header says {num_values} metadata values, but the {cursor.left()} bytes after "
                              f"it hold at most {cursor.left() // MIN_METADATA_BYTES}: {CUT_SHORT}, or lies")
    metadata: dict = {}
    for index in range(num_values):
        key = cursor.string(f"metadata key {index}")
        if key in metadata:
            raise GGUFFormatError(f"metadata key {key!r} appears twice")
        value_type = cursor.scalar("I", f"the type of metadata {key!r}")
        metadata[key] = _value(cursor, value_type, key, 0)
    metadata_end = cursor.pos
    if num_tensors * MIN_TENSOR_INFO_BYTES > cursor.left():
        raise GGUFFormatError(f"the header says {num_tensors} tensors, but the {cursor.left()} bytes after the "
                              f"metadata hold at most {cursor.left() // MIN_TENSOR_INFO_BYTES} tensor infos: "
                              f"{CUT_SHORT}, or lies")
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
        raise GGUFFormatError(f"general.alignment must be a power of two, got {alignment!r}")
    infos = [_tensor_info(cursor, index) for index in range(num_tensors)]
    data_start = -(-cursor.pos // alignment) * alignment
    tensors: dict = {}
    for name, dims, ggml_type, offset in infos:
        if name in tensors:
            raise GGUFFormatError(f"tensor {name!r} appears twice")
        tensors[name] = _record(name, dims, ggml_type, offset, alignment, data_start, size)
    _check_disjoint(tensors.values())
    digest = hashlib.blake2b(cursor.buffer[:metadata_end], digest_size=16)
    digest.update(f"size:{size}".encode())
    return GGUFFile(path, size, version, metadata, tensors, data_start, metadata_end, digest.hexdigest())


def _value(cursor: _Cursor, value_type: int, key: str, depth: int):
    if value_type in SCALARS:
        return cursor.scalar(SCALARS[value_type], f"metadata {key!r}")
    if value_type == STRING:
        return cursor.string(f"metadata {key!r}")
    if value_type != ARRAY:
        raise GGUFFormatError(f"metadata {key!r} has value type {value_type}, which is not a GGUF value type")
    if depth >= MAX_ARRAY_DEPTH:
        raise GGUFFormatError(f"metadata {key!r} nests arrays deeper than {MAX_ARRAY_DEPTH}")
    item_type = cursor.scalar("I", f"the item type of metadata {key!r}")
    count = cursor.scalar("Q", f"the length of metadata {key!r}")
    if item_type in SCALARS:
        return cursor.scalars(SCALARS[item_type], count, f"metadata {key!r} ({count} items)")
    if item_type not in MIN_ITEM_BYTES:
        raise GGUFFormatError(f"metadata {key!r} is an array of value type {item_type}, which is not a GGUF type")
    if count * MIN_ITEM_BYTES[item_type] > cursor.left():
        raise GGUFFormatError(f"metadata {key!r} says {count} items, but the {cursor.left()} bytes left hold at "
                              f"most {cursor.left() // MIN_ITEM_BYTES[item_type]}: {CUT_SHORT}, or lies")
    return [_value(cursor, item_type, key, depth + 1) for _ in range(count)]


def _tensor_info(cursor: _Cursor, index: int) -> tuple[str, list[int], int, int]:
    name = cursor.string(f"the name of tensor {index}")
    num_dims = cursor.scalar("I", f"the dimension count of tensor {name!r}")
    if not 1 <= num_dims <= MAX_DIMS:
        raise GGUFFormatError(f"tensor {name!r} has {num_dims} dimensions; a GGUF tensor has 1 to {MAX_DIMS}")
    dims = [cursor.scalar("Q", f"the dimensions of tensor {name!r}") for _ in range(num_dims)]
    ggml_type = cursor.scalar("I", f"the type of tensor {name!r}")
    offset = cursor.scalar("Q", f"the data offset of tensor {name!r}")
    return name, dims, ggml_type, offset


def _record(name: str, dims: list[int], ggml_type: int, offset: int, alignment: int, data_start: int,
            size: int) -> TensorRecord:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        kind = GGMLQuantizationType(ggml_type)
    except ValueError:
        raise GGUFFormatError(f"tensor {name!r} has type {ggml_type}, which is no GGML tensor type") from None
    if any(d < 1 for d in dims):
        raise GGUFFormatError(f"tensor {name!r} has dimensions {dims}; each must be at least 1")
    block, block_bytes = GGML_QUANT_SIZES[kind]
    if dims[0] % block:
        raise GGUFFormatError(f"tensor {name!r} ({kind.name}) has rows of {dims[0]} values, not a multiple of its "
                              f"block of {block}")
    elements = 1
    for d in dims:
        elements *= d
    nbytes = elements // block * block_bytes
    if offset % alignment:
        raise GGUFFormatError(f"tensor {name!r} starts at data offset {offset}, not a multiple of the alignment "
                              f"{alignment}")
    start = data_start + offset
    if nbytes > size or start + nbytes > size:  # the first test keeps a lying size from overflowing nothing
        raise GGUFFormatError(f"tensor {name!r} ({kind.name} {list(reversed(dims))}, {nbytes} bytes at offset "
                              f"{start}) ends past the end of the file ({size} bytes): {CUT_SHORT}")
    return TensorRecord(name, kind.name, ggml_type, tuple(reversed(dims)), start, nbytes)


def _check_disjoint(records) -> None:
    """Refuses tensors whose bytes overlap. Writers lay tensors out one after another; an overlap means a type or
    shape that is not the one the bytes were written with (a type swapped for a larger one reads its neighbour's
    bytes as its own)."""
    ordered = sorted(records, key=lambda r: r.offset)
    for first, second in zip(ordered, ordered[1:]):
        if first.offset + first.nbytes > second.offset:
            raise GGUFFormatError(f"tensor {first.name!r} ({first.type_name} {list(first.shape)}, {first.nbytes} "
                                  f"bytes at offset {first.offset}) overlaps tensor {second.name!r} at offset "
                                  f"{second.offset}: its type or shape is not the one its bytes were written with")


def row_layout(record: TensorRecord) -> tuple[int, int]:
    """(rows, bytes per row) of `record` as stored: a matrix's rows, a 1-D tensor as one row."""
    rows = 1
    for d in record.shape[:-1]:
        rows *= d
    return rows, record.nbytes // rows


def read_rows(file: GGUFFile, record: TensorRecord, start: int = 0, stop: int | None = None,
              out: np.ndarray | None = None) -> np.ndarray:
    """The stored bytes of rows [start, stop) of `record` (stop None: to the last), uint8 [rows, bytes per row],
    read into `out` (C-contiguous, of that shape) or a new array, then checked by `check_finite`. File reads, not
    a mapping (the module docstring): a file cut short since its header was read is a GGUFFormatError saying at
    which byte it ended."""
    rows, row_bytes = row_layout(record)
    stop = rows if stop is None else stop
    assert 0 <= start <= stop <= rows, (record.name, start, stop, rows)
    if out is None:
        out = np.empty((stop - start, row_bytes), dtype=np.uint8)
    assert out.shape == (stop - start, row_bytes) and out.dtype == np.uint8, (out.shape, out.dtype)
    target = memoryview(out).cast("B")
    begin, nbytes = record.offset + start * row_bytes, (stop - start) * row_bytes
    with open(file.path, "rb", buffering=0) as handle:
        handle.seek(begin)
        filled = 0
        while filled < nbytes:
            got = handle.readinto(target[filled:])
            if not got:
                now = os.fstat(handle.fileno()).st_size
                raise GGUFFormatError(f"the file ended at byte {now} while reading tensor {record.name!r} (bytes "
                                      f"{begin} to {begin + nbytes}), {file.size} bytes when its header was read: "
                                      f"{CUT_SHORT}")
            filled += got
    check_finite(record, out, start)
    return out


def check_finite(record: TensorRecord, data: np.ndarray, first_row: int = 0) -> None:
    """Raises GGUFFormatError unless every fp16 scale of every block (SCALE_FIELDS) of `data`, rows
    [first_row, first_row + len(data)) of `record` as stored, or every value of a float tensor, is finite; the
    message names the tensor, the field, the block and row (or row and column) and the value. A view of the scales'
    bits, strided over the blocks, and one mask of their exponent bits per field: ~1/16 of the bytes touched."""
    fields = SCALE_FIELDS.get(record.type_name)
    if fields is not None:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[record.type_name]][1]
        blocks = data.reshape(-1, block_bytes)  # [blocks, block bytes]: rows hold whole blocks
        per_row = data.shape[1] // block_bytes
        for field_name, at in fields:
            bits = blocks[:, at:at + 2].view("<u2")[:, 0]
            bad = (bits & FP16_EXPONENT) == FP16_EXPONENT
            if bad.any():
                bad = np.flatnonzero(bad)
                index = int(bad[0])
                value = float(bits[index:index + 1].view("<f2")[0])
                raise GGUFFormatError(
                    f"tensor {record.name!r} ({record.type_name}) has a non-finite scale: {field_name} of block "
                    f"{index % per_row} of row {first_row + index // per_row} is {value} ({bad.size} such "
                    f"block(s) in these rows): the file is damaged or not what its header says")
        return
    if record.type_name in FLOAT_BITS:
        code, mask = FLOAT_BITS[record.type_name]
        bits = data.reshape(-1).view(code)
        bad = (bits & mask) == mask
        if bad.any():
            bad = np.flatnonzero(bad)
            index, columns = int(bad[0]), data.shape[1] // np.dtype(code).itemsize
            as_float = {"F16": "<f2", "F32": "<f4"}.get(record.type_name)
            value = float(bits[index:index + 1].view(as_float)[0]) if as_float else \
                float(np.array([int(bits[index]) << 16], dtype="<u4").view("<f4")[0])  # bfloat16: float32's top
            raise GGUFFormatError(
                f"tensor {record.name!r} ({record.type_name}) has a non-finite value: row "
                f"{first_row + index // columns}, column {index % columns} is {value} ({bad.size} such value(s) "
                f"in these rows): the file is damaged or not what its header says")
