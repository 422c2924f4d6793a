"""The payload file format of the disk KV tier: one file per store entry, read in one go.

A payload file is a fixed header, a JSON description, then the tensors' raw bytes, each at a 64-byte aligned
offset:

    MAGIC (8 bytes) | header length (uint32 LE) | checksum (16 bytes) | header JSON | padding | data
    checksum: xxh3-128 of the header JSON and the data (a changed shape, offset or token is caught like a
              changed value; ~13 GB/s, so checking never bounds a restore)
    header: {"format", "namespace", "key", "quant", "num_tokens", "data_bytes",
             "entry": {"kind", "parent", "start", "tokens", "exact", "lossy"},
             "tensors": [{"dtype", "shape", "offset", "nbytes"}, ...], "layers": [[k_desc, v_desc], ...]}

The header says what the payload is the KV of (its key, parent, position and token ids), under the checksum, so
a reader proves that the index row, the file and the prompt agree before any reuse (engine.kv.disk).

Reading opens regular files only (no symlinks, FIFOs or devices), never more bytes than it was told to expect,
reads the whole file into one buffer with a single read and hands out the tensors as views of it (no per-tensor
copies). Anything wrong raises PayloadError saying what; the disk tier turns that into a MISS.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import struct
from pathlib import Path

import torch
import xxhash

from .kv_quant import QuantizedTensor
from .tiers import StoredKV

MAGIC = b"KVBKV\x00\x03\x00"
FORMAT_VERSION = 3
DIGEST_BYTES = 16
ALIGN = 64
_PREFIX = len(MAGIC) + 4 + DIGEST_BYTES
_DTYPES = {str(dt): dt for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8)}
ENTRY_FIELDS = ("kind", "parent", "start", "tokens", "exact", "lossy")


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _describe(part, add) -> dict:
    if isinstance(part, QuantizedTensor):
        return {"quantized": True, "bits": part.bits, "axis": part.axis, "group_size": part.group_size,
                "shape": list(part.shape), "dtype": str(part.dtype),
                "data": add(part.data), "scale": add(part.scale), "zero": add(part.zero)}
    return {"quantized": False, "tensor": add(part)}


def _checksum(head, data) -> bytes:
    h = xxhash.xxh3_128(head)
    h.update(data)
    return h.digest()


def encode_file(stored: StoredKV, namespace: str, key: bytes, entry: dict | None = None) -> bytes:
    """The bytes of a payload file for `stored`. `entry`: what it is the KV of (ENTRY_FIELDS), checked on read."""
    blobs: list[bytes] = []
    tensors: list[dict] = []
    offset = 0

    def add(t: torch.Tensor) -> int:
        nonlocal offset
        raw = _tensor_bytes(t)
        pad = -offset % ALIGN
        if pad:
            blobs.append(b"\0" * pad)
            offset += pad
        tensors.append({"dtype": str(t.dtype), "shape": list(t.shape), "offset": offset, "nbytes": len(raw)})
        blobs.append(raw)
        offset += len(raw)
        return len(tensors) - 1

    layers = [[_describe(k, add), _describe(v, add)] for k, v in stored.layers]
    data = b"".join(blobs)
    header = {"format": FORMAT_VERSION, "namespace": namespace, "key": key.hex(), "quant": stored.quant,
              "num_tokens": stored.num_tokens, "data_bytes": len(data), "entry": dict(entry or {}),
              "tensors": tensors, "layers": layers}
    head = json.dumps(header, separators=(",", ":")).encode()
    prefix = MAGIC + struct.pack("<I", len(head)) + _checksum(head, data) + head
    return prefix + b"\0" * (-len(prefix) % ALIGN) + data


# Bound on a header's JSON (engine.kv.remote_tier refuses longer values unread): the fixed fields with the
# namespace, key and parent, each tensor's and part's description, each token id (at most 10 digits and a comma).
HEADER_BYTES = 2048
TENSOR_HEADER_BYTES = 256
TOKEN_HEADER_BYTES = 12


def max_file_bytes(data_bytes: int, num_tensors: int, num_tokens: int) -> int:
    """The most bytes a payload file of `num_tensors` tensors holding `data_bytes` of data for `num_tokens`
    tokens can take: the prefix, the header, each tensor's alignment, the data."""
    return _PREFIX + ALIGN + HEADER_BYTES + num_tensors * (TENSOR_HEADER_BYTES + ALIGN) + \
        num_tokens * TOKEN_HEADER_BYTES + data_bytes


class PayloadError(Exception):
    """A payload file that cannot be trusted (missing, truncated, corrupt, someone else's, not a file)."""


def read_file(path: Path, max_bytes: int | None = None) -> torch.Tensor:
    """The whole file as one uint8 tensor, read with O_NOFOLLOW from a regular file of at most `max_bytes`."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | \
        getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise PayloadError("file missing") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PayloadError("a symbolic link, not a payload file") from None
        raise PayloadError(f"unreadable ({exc.strerror or exc})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise PayloadError("not a regular file")
        size = info.st_size
        if size == 0:
            raise PayloadError("empty file")
        if max_bytes is not None and size > max_bytes:
            raise PayloadError(f"{size} bytes, more than the {max_bytes} expected")
        buf = torch.empty(size, dtype=torch.uint8)
        view = memoryview(buf.numpy())
        done = 0
        while done < size:
            try:
                n = os.readv(fd, [view[done:]]) if hasattr(os, "readv") else _read_into(fd, view[done:])
            except OSError as exc:
                raise PayloadError(f"read failed ({exc.strerror or exc})") from None
            if n == 0:
                raise PayloadError(f"short read: {done} of {size} bytes")
            done += n
        view.release()
        return buf
    finally:
        os.close(fd)


def _read_into(fd: int, view: memoryview) -> int:
    chunk = os.read(fd, len(view))
    view[:len(chunk)] = chunk
    return len(chunk)


def read_header(buf) -> tuple[dict, bytes, int, int]:
    """(header, checksum, header start, data start) of a payload file's bytes."""
    raw = memoryview(buf)
    if len(raw) < _PREFIX or bytes(raw[:len(MAGIC)]) != MAGIC:
        raise PayloadError("not a KVBoost payload file of this version (bad magic)")
    (head_len,) = struct.unpack_from("<I", raw, len(MAGIC))
    checksum = bytes(raw[len(MAGIC) + 4:_PREFIX])
    if _PREFIX + head_len > len(raw):
        raise PayloadError("truncated header")
    try:
        header = json.loads(bytes(raw[_PREFIX:_PREFIX + head_len]))
    except (ValueError, RecursionError):
        raise PayloadError("unreadable header") from None
    if not isinstance(header, dict):
        raise PayloadError("unreadable header")
    data_start = _PREFIX + head_len
    data_start += -data_start % ALIGN
    return header, checksum, _PREFIX, data_start


def decode_file(path: Path, namespace: str | None, key: bytes | None, verify: bool = True,
                expect: dict | None = None, max_bytes: int | None = None) -> StoredKV:
    """Reads and checks a payload file; PayloadError says what is wrong with it. `expect`: entry fields
    (ENTRY_FIELDS) the file must carry with exactly these values (the index row's, the prompt's)."""
    return decode_bytes(read_file(path, max_bytes), namespace, key, verify, expect)


def decode_bytes(buf: torch.Tensor, namespace: str | None, key: bytes | None, verify: bool = True,
                 expect: dict | None = None) -> StoredKV:
    """decode_file over bytes already read (a uint8 tensor); the tensors returned are views of `buf`."""
    raw = buf.numpy()
    try:
        header, checksum, head_start, data_start = read_header(raw)
        if header.get("format") != FORMAT_VERSION:
            raise PayloadError(f"format {header.get('format')!r}, expected {FORMAT_VERSION}")
        if namespace is not None and header.get("namespace") != namespace:
            raise PayloadError("written by another model or engine setting")
        if key is not None and header.get("key") != key.hex():
            raise PayloadError("holds another entry")
        data_bytes = header.get("data_bytes")
        if not isinstance(data_bytes, int) or data_start + data_bytes != len(raw):
            raise PayloadError(f"size {len(raw)} bytes, header says {data_start}+{data_bytes!r}")
        if verify:
            if _checksum(raw[head_start:head_start + _head_len(raw)], raw[data_start:]) != checksum:
                raise PayloadError("checksum mismatch")
        entry = header.get("entry")
        for name, value in (expect or {}).items():
            if not isinstance(entry, dict) or entry.get(name) != value:
                raise PayloadError(f"the file's {name} is not the index row's (the row or the file was changed)")
        tensors = [_load_tensor(buf, data_start, data_bytes, desc) for desc in header["tensors"]]
        layers = tuple((_part(k, tensors), _part(v, tensors)) for k, v in header["layers"])
        num_tokens = header["num_tokens"]
        if not layers or not isinstance(num_tokens, int) or header.get("quant") not in ("none", "int8", "int4"):
            raise PayloadError("malformed header (no layers, or a bad token count or quant)")
        return StoredKV(layers, header["quant"], num_tokens)
    except PayloadError:
        raise
    except Exception as exc:  # a header that passed the checksum but still does not describe tensors
        raise PayloadError(f"malformed header ({type(exc).__name__}: {exc})") from None


def _head_len(raw) -> int:
    return struct.unpack_from("<I", raw, len(MAGIC))[0]


def _load_tensor(buf: torch.Tensor, data_start: int, data_bytes: int, desc: dict) -> torch.Tensor:
    dtype = _DTYPES.get(desc["dtype"])
    if dtype is None:
        raise PayloadError(f"unknown dtype {desc['dtype']!r}")
    offset, nbytes, shape = desc["offset"], desc["nbytes"], [int(s) for s in desc["shape"]]
    size = dtype.itemsize
    count = 1
    for s in shape:
        if s < 0:
            raise PayloadError("negative dimension")
        count *= s
    if not (isinstance(offset, int) and isinstance(nbytes, int)) or offset < 0 or offset % size \
            or nbytes != count * size or offset + nbytes > data_bytes:
        raise PayloadError("a tensor outside the data, misaligned, or of the wrong size")
    start = data_start + offset
    return buf[start:start + nbytes].view(dtype).reshape(shape)


def _part(desc: dict, tensors: list[torch.Tensor]):
    if not desc["quantized"]:
        return tensors[desc["tensor"]]
    return QuantizedTensor(tensors[desc["data"]], tensors[desc["scale"]], tensors[desc["zero"]], desc["bits"],
                           desc["axis"], desc["group_size"], tuple(desc["shape"]), _DTYPES[desc["dtype"]])
