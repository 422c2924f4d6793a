"""Reading a GGUF file's header into plain records, every count, length and offset checked against the file.

A GGUF file is outside input: its header says how many metadata values and tensors follow, how long each string
and array is, and where each tensor's bytes lie. gguf-py's reader trusts those numbers (an array of 2**60 one-byte
items keeps it looping past the end of the file for good), so a file is walked here first, with nothing allocated
from a number before that number is checked against the bytes that are actually there:

    magic "GGUF", version (2 or 3), tensor count (u64), metadata count (u64)
    metadata: key (u64 length + bytes), value type (u32), value (scalar, string, or array: type, u64 count, items)
    tensor infos: name, n_dims (u32, 1..4), dims (u64 each, fastest-moving first), ggml type (u32), offset (u64)
    padding to general.alignment (32 unless stated), then the tensor data; each offset is from there

A problem is a GGUFFormatError naming the key or tensor and the numbers. Tensor data is never read here:
`tensor_data` gives a read-only view of the memory-mapped file, paged in only when used.
"""

from __future__ import annotations

import hashlib
import mmap
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
    """Reads little-endian values from a buffer, refusing any read past `end`."""

    def __init__(self, buffer, end: int, pos: int = 0):
        self.buffer, self.end, self.pos = buffer, end, pos

    def left(self) -> int:
        return self.end - self.pos

    def need(self, nbytes: int, what: str) -> None:
        if nbytes > self.left():
            raise GGUFFormatError(f"{what} needs {nbytes} bytes at offset {self.pos}, but the file ends "
                                  f"{self.left()} bytes later")

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
    """The header of the GGUF file at `path`, checked (GGUFFormatError otherwise). Reads only the header's bytes."""
    path = str(path)
    with open(path, "rb") as handle:
        size = handle.seek(0, 2)
        if size < 24:
            raise GGUFFormatError(f"{path} is {size} bytes: too short for a GGUF header (24 bytes)")
        buffer = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _parse(path, buffer, size)
    finally:
        buffer.close()


def _parse(path: str, buffer, size: int) -> GGUFFile:
    cursor = _Cursor(buffer, size)
    if bytes(buffer[:4]) != b"GGUF":
        raise GGUFFormatError(f"{path} does not start with the GGUF magic bytes (starts with {bytes(buffer[:4])!r})")
    cursor.pos = 4
    version = cursor.scalar("I", "the version")
    if version not in VERSIONS:
        raise GGUFFormatError(f"GGUF version {version} is not readable here (versions {VERSIONS})")
    num_tensors = cursor.scalar("Q", "the tensor count")
    num_values = cursor.scalar("Q", "the metadata count")
    if num_values * MIN_METADATA_BYTES > cursor.left():
        raise GGUFFormatError(f"the header says {num_values} metadata values, but the {cursor.left()} bytes after "
                              f"it hold at most {cursor.left() // MIN_METADATA_BYTES}")
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
                              f"metadata hold at most {cursor.left() // MIN_TENSOR_INFO_BYTES} tensor infos")
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
    digest = hashlib.blake2b(buffer[:metadata_end], digest_size=16)
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
                              f"most {cursor.left() // MIN_ITEM_BYTES[item_type]}")
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
                              f"{start}) ends past the end of the file ({size} bytes)")
    return TensorRecord(name, kind.name, ggml_type, tuple(reversed(dims)), start, nbytes)


def tensor_data(file: GGUFFile, record: TensorRecord) -> np.ndarray:
    """The stored bytes of `record`, uint8 [rows, bytes per row] (1-D tensors: [1, bytes]), a read-only view of
    the memory-mapped file: nothing is read until it is used."""
    data = np.memmap(file.path, dtype=np.uint8, mode="r", offset=record.offset, shape=(record.nbytes,))
    rows = 1
    for d in record.shape[:-1]:
        rows *= d
    return data.reshape(rows, record.nbytes // rows)
