"""Property-based tests of what the disk tier reads from files anyone may edit: payload file bytes and index rows.
Arbitrary bytes and values give a MISS (PayloadError) or a dropped row, never another exception or a wrong entry."""

from __future__ import annotations

import json
import sqlite3
import struct

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.keys import chain_key
from engine.kv.disk import DiskTier
from engine.kv.disk_rows import parse_row
from engine.kv.eviction import LRU
from engine.kv.payload_file import MAGIC, PayloadError, _checksum, decode_bytes, encode_file
from engine.kv.store import ChunkStore
from engine.kv.tiers import decode_kv, encode_kv

ROOT = b"r" * 16
TOKENS = tuple(range(5, 13))
KEY = chain_key(ROOT, TOKENS)
ENTRY = {"kind": "chunk", "parent": ROOT.hex(), "start": 0, "tokens": list(TOKENS), "exact": True, "lossy": False}
KV = tuple((torch.arange(64, dtype=torch.float32).reshape(1, 2, 8, 4) + i,
            -torch.arange(64, dtype=torch.float32).reshape(1, 2, 8, 4) - i) for i in range(2))
GOOD = {quant: encode_file(encode_kv(KV, quant, torch.device("cpu")), "ns", KEY, ENTRY)
        for quant in ("none", "int8", "int4")}
FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def decode(blob: bytes, **kwargs):
    buf = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
    return decode_bytes(buf, "ns", KEY, **kwargs)


def test_a_good_file_decodes_to_its_tensors():
    stored = decode(GOOD["none"], expect=ENTRY)
    for (k, v), (k2, v2) in zip(KV, stored.layers):
        assert torch.equal(k, k2) and torch.equal(v, v2)


@FAST
@given(st.binary(max_size=4096))
def test_arbitrary_bytes_are_a_miss(blob):
    try:
        decode(blob)
    except PayloadError:
        return
    raise AssertionError("arbitrary bytes decoded as a payload")


@FAST
@given(st.sampled_from(sorted(GOOD)), st.data())
def test_any_changed_byte_truncation_or_insertion_of_a_good_file_is_a_miss(quant, data):
    blob = bytearray(GOOD[quant])
    action = data.draw(st.sampled_from(["flip", "truncate", "insert", "append"]))
    at = data.draw(st.integers(0, len(blob) - 1))
    if action == "flip":
        blob[at] ^= data.draw(st.integers(1, 255))
    elif action == "truncate":
        del blob[at:]
    elif action == "insert":
        blob[at:at] = data.draw(st.binary(min_size=1, max_size=64))
    else:
        blob += data.draw(st.binary(min_size=1, max_size=64))
    try:
        stored = decode(bytes(blob), expect=ENTRY)
    except PayloadError:
        return
    # only a change in the padding between header and data (not under the checksum) leaves a file that checks
    good = GOOD[quant]
    (head_len,) = struct.unpack_from("<I", good, len(MAGIC))
    head_end = len(MAGIC) + 4 + 16 + head_len
    assert action == "flip" and head_end <= at < head_end + (-head_end % 64)
    cpu = torch.device("cpu")
    for (k, v), (k2, v2) in zip(decode_kv(decode(good), cpu), decode_kv(stored, cpu)):
        assert torch.equal(k, k2) and torch.equal(v, v2)


scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
json_values = scalars | st.lists(scalars, max_size=4) | st.dictionaries(st.text(max_size=8), scalars, max_size=4)


@FAST
@given(st.data())
def test_a_header_that_checks_but_lies_is_a_miss_or_stays_within_the_file(data):
    """A header rewritten with a recomputed checksum (what a careful vandal could do): any field replaced by any
    JSON value. Decoding raises PayloadError or returns tensors inside the file; never another exception."""
    blob = GOOD[data.draw(st.sampled_from(sorted(GOOD)))]
    (head_len,) = struct.unpack_from("<I", blob, len(MAGIC))
    prefix = len(MAGIC) + 4 + 16
    header = json.loads(blob[prefix:prefix + head_len])
    data_start = prefix + head_len + (-(prefix + head_len) % 64)
    body = blob[data_start:]
    path = data.draw(st.sampled_from(["format", "namespace", "key", "quant", "num_tokens", "data_bytes",
                                      "entry", "tensors", "layers", "tensors.0", "layers.0", "tensors.0.shape",
                                      "tensors.0.offset", "tensors.0.nbytes", "tensors.0.dtype", "layers.0.0"]))
    value = data.draw(json_values)
    target = header
    parts = path.split(".")
    for part in parts[:-1]:
        target = target[int(part)] if isinstance(target, list) else target[part]
    last = parts[-1]
    if isinstance(target, list):
        target[int(last)] = value
    else:
        target[last] = value
    head = json.dumps(header, separators=(",", ":"), allow_nan=True).encode()
    start = prefix + len(head)
    forged = MAGIC + struct.pack("<I", len(head)) + _checksum(head, body) + head + b"\0" * (-start % 64) + body
    try:
        stored = decode(forged)
    except PayloadError:
        return
    for k, v in stored.layers:
        for part in (k, v):
            tensors = [part] if isinstance(part, torch.Tensor) else [part.data, part.scale, part.zero]
            for t in tensors:
                assert t.numel() * t.element_size() <= len(forged)


row_values = st.one_of(st.none(), st.integers(-2**70, 2**70), st.floats(allow_nan=True), st.text(max_size=40),
                       st.binary(max_size=40), st.booleans())


def good_row(row_id=1) -> dict:
    return {"id": row_id, "key": KEY.hex(), "kind": "chunk", "parent": ROOT.hex(), "content_key": "cd" * 16,
            "start": 0, "tokens": np.asarray(TOKENS, dtype="<i4").tobytes(), "exact": 1, "num_bytes": 100,
            "raw_bytes": 50, "importance": 1.5, "hits": 0, "lossy": 0,
            "file": f"payloads/{KEY.hex()[:2]}/{KEY.hex()}-0011aabb.kv"}


def test_a_good_row_parses():
    parsed = parse_row(good_row())
    assert parsed is not None and parsed["key"] == KEY and parsed["tokens"] == TOKENS


@FAST
@given(st.dictionaries(st.sampled_from(sorted(good_row())), row_values, min_size=1))
def test_any_changed_row_field_is_dropped_or_still_describes_its_key(changes):
    row = {**good_row(), **changes}
    parsed = parse_row(row)
    if parsed is None:
        return
    # a row that survives names its own payload and its key is its parent + tokens
    assert parsed["key"] == chain_key(parsed["parent"], parsed["tokens"])
    assert row["file"].startswith("payloads/") and ".." not in row["file"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(["key", "kind", "parent", "content_key", "start", "tokens", "exact",
                                        "num_bytes", "raw_bytes", "importance", "hits", "lossy", "file"]),
                       row_values, min_size=1, max_size=4))
def test_a_store_opening_an_index_with_any_bad_row_starts_and_keeps_the_good_rows(tmp_path_factory, changes):
    folder = tmp_path_factory.mktemp("kv")
    writer = ChunkStore(0, LRU(), disk=DiskTier(folder, 1 << 30, "none", namespace="ns"))
    assert writer.put_chunk(KEY, ROOT, b"c" * 16, 0, TOKENS, KV)
    other_tokens = tuple(range(20, 28))
    other = chain_key(ROOT, other_tokens)
    assert writer.put_chunk(other, ROOT, b"d" * 16, 0, other_tokens, KV)
    db = sqlite3.connect(folder / "index.sqlite3", isolation_level=None)
    assignments = ", ".join(f"{name} = ?" for name in changes)
    try:
        db.execute(f"UPDATE entries SET {assignments} WHERE key = ?", [*changes.values(), other.hex()])
    except (sqlite3.IntegrityError, OverflowError):  # NOT NULL / UNIQUE, or an int SQLite cannot hold
        return
    finally:
        db.close()
    reader = ChunkStore(0, LRU(), disk=DiskTier(folder, 1 << 30, "none", namespace="ns"))
    assert KEY in reader.records  # the untouched row still serves
    record = reader.records[KEY]
    reader.acquire(record)
    assert reader.fetch(record)
    reader.release(record)
    for key, rec in reader.records.items():
        assert key == chain_key(rec.parent, rec.tokens)
