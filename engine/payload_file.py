"""The payload file format of the disk KV tier: one file per store entry, memory-mappable.

A payload file is a fixed header, a JSON description, then the tensors' raw bytes, each at a 64-byte aligned
offset, so a reader can memory-map it:

    MAGIC (8 bytes) | header length (uint32 LE) | checksum (16 bytes) | header JSON | padding | data
    checksum: blake2b-128 of the header JSON and the data (a changed shape or offset is caught like a changed value)
    header: {"namespace", "key", "quant", "num_tokens", "data_bytes",
             "tensors": [{"dtype", "shape", "offset", "nbytes"}, ...], "layers": [[k_desc, v_desc], ...]}

Reading checks everything it can (size, version, owner, entry, checksum, that the header describes tensors) and
raises PayloadError saying what is wrong; the disk tier (engine.disk) turns that into a MISS.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from pathlib import Path

import numpy as np
import torch

from .kv_quant import QuantizedTensor
from .tiers import StoredKV

MAGIC = b"KVBKV\x00\x02\x00"
FORMAT_VERSION = 2
DIGEST_BYTES = 16
ALIGN = 64
_DTYPES = {str(dt): dt for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8)}
_NUMPY = {"torch.uint8": np.uint8, "torch.float16": np.float16, "torch.float32": np.float32,
          "torch.float64": np.float64, "torch.bfloat16": np.uint16}


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.uint16) if hasattr(torch, "uint16") else t.view(torch.int16)
    return t.numpy().tobytes()


def _describe(part, add) -> dict:
    if isinstance(part, QuantizedTensor):
        return {"quantized": True, "bits": part.bits, "axis": part.axis, "group_size": part.group_size,
                "shape": list(part.shape), "dtype": str(part.dtype),
                "data": add(part.data), "scale": add(part.scale), "zero": add(part.zero)}
    return {"quantized": False, "tensor": add(part)}


def encode_file(stored: StoredKV, namespace: str, key: bytes) -> bytes:
    """The bytes of a payload file for `stored`."""
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
              "num_tokens": stored.num_tokens, "data_bytes": len(data), "tensors": tensors, "layers": layers}
    head = json.dumps(header, separators=(",", ":")).encode()
    digest = hashlib.blake2b(head, digest_size=DIGEST_BYTES)
    digest.update(data)
    prefix = MAGIC + struct.pack("<I", len(head)) + digest.digest() + head
    return prefix + b"\0" * (-len(prefix) % ALIGN) + data


class PayloadError(Exception):
    """A payload file that cannot be trusted (missing, truncated, corrupt, someone else's)."""


def read_header(mm) -> tuple[dict, bytes, int, int]:
    """(header, checksum, header start, data start) of a mapped payload file."""
    if len(mm) < len(MAGIC) + 4 + DIGEST_BYTES or mm[:len(MAGIC)] != MAGIC:
        raise PayloadError("not a KVBoost payload file of this version (bad magic)")
    (head_len,) = struct.unpack_from("<I", mm, len(MAGIC))
    checksum = bytes(mm[len(MAGIC) + 4:len(MAGIC) + 4 + DIGEST_BYTES])
    start = len(MAGIC) + 4 + DIGEST_BYTES
    if start + head_len > len(mm):
        raise PayloadError("truncated header")
    try:
        header = json.loads(bytes(mm[start:start + head_len]))
    except ValueError:
        raise PayloadError("unreadable header") from None
    if not isinstance(header, dict):
        raise PayloadError("unreadable header")
    data_start = start + head_len
    data_start += -data_start % ALIGN
    return header, checksum, start, data_start


def decode_file(path: Path, namespace: str | None, key: bytes | None, verify: bool = True) -> StoredKV:
    """Reads and checks a payload file; PayloadError says what is wrong with it."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise PayloadError("empty file")
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except FileNotFoundError:
        raise PayloadError("file missing") from None
    except (OSError, ValueError) as exc:
        raise PayloadError(f"unreadable ({exc})") from None
    try:
        header, checksum, head_start, data_start = read_header(mm)
        if header.get("format") != FORMAT_VERSION:
            raise PayloadError(f"format {header.get('format')!r}, expected {FORMAT_VERSION}")
        if namespace is not None and header.get("namespace") != namespace:
            raise PayloadError("written by another model or engine setting")
        if key is not None and header.get("key") != key.hex():
            raise PayloadError("holds another entry")
        if data_start + header["data_bytes"] != len(mm):
            raise PayloadError(f"size {len(mm)} bytes, header says {data_start + header['data_bytes']}")
        if verify:
            head = memoryview(mm)[head_start:head_start + _head_len(mm)]
            data = memoryview(mm)[data_start:]
            try:
                digest = hashlib.blake2b(head, digest_size=DIGEST_BYTES)
                digest.update(data)
                if digest.digest() != checksum:
                    raise PayloadError("checksum mismatch")
            finally:
                head.release()
                data.release()
        tensors = [_load_tensor(mm, data_start, desc) for desc in header["tensors"]]
        layers = tuple((_part(k, tensors), _part(v, tensors)) for k, v in header["layers"])
        return StoredKV(layers, header["quant"], header["num_tokens"])
    except PayloadError:
        raise
    except Exception as exc:  # a header that passed the checksum but still does not describe tensors
        raise PayloadError(f"malformed header ({type(exc).__name__}: {exc})") from None
    finally:
        mm.close()


def _head_len(mm) -> int:
    return struct.unpack_from("<I", mm, len(MAGIC))[0]


def _load_tensor(mm, data_start: int, desc: dict) -> torch.Tensor:
    dtype = desc["dtype"]
    if dtype not in _NUMPY:
        raise PayloadError(f"unknown dtype {dtype!r}")
    arr = np.frombuffer(mm, dtype=_NUMPY[dtype], count=desc["nbytes"] // np.dtype(_NUMPY[dtype]).itemsize,
                        offset=data_start + desc["offset"]).copy()  # owned: the map closes after reading
    t = torch.from_numpy(arr).reshape(desc["shape"])
    return t.view(torch.bfloat16) if dtype == "torch.bfloat16" else t


def _part(desc: dict, tensors: list[torch.Tensor]):
    if not desc["quantized"]:
        return tensors[desc["tensor"]]
    return QuantizedTensor(tensors[desc["data"]], tensors[desc["scale"]], tensors[desc["zero"]], desc["bits"],
                           desc["axis"], desc["group_size"], tuple(desc["shape"]), _DTYPES[desc["dtype"]])
