"""What an index row must say about itself before the disk tier trusts it, case by case: its key is the key the
engine stores that kind of entry under (a tail's key is not its chunk's), and its file name is the one the tier
writes for that key, folder included."""

from __future__ import annotations

import numpy as np
import pytest

from engine.keys import chain_key
from engine.kv.disk_rows import expected_key, is_payload_name, parse_row

ROOT = b"r" * 16
TOKENS = (5, 6, 7, 8, 9, 10, 11, 12)


def row(kind: str, key: bytes, **changes) -> dict:
    fields = {"id": 1, "key": key.hex(), "kind": kind, "parent": ROOT.hex(),
              "content_key": "cd" * 16 if kind == "chunk" else None,
              "start": 0, "tokens": np.asarray(TOKENS, dtype="<i4").tobytes(), "exact": 1, "num_bytes": 100,
              "raw_bytes": 50, "importance": 1.5, "hits": 0, "lossy": 0,
              "file": f"payloads/{key.hex()[:2]}/{key.hex()}-0011aabb.kv"}
    return {**fields, **changes}


def test_a_tail_and_a_chunk_of_the_same_tokens_have_different_keys():
    tail, chunk = expected_key("tail", ROOT, TOKENS, True), expected_key("chunk", ROOT, TOKENS, True)
    assert tail != chunk and chunk == chain_key(ROOT, TOKENS)
    assert expected_key("chunk", ROOT, TOKENS, False) not in (tail, chunk)  # inexact chunks apart as well
    assert parse_row(row("tail", tail))["key"] == tail
    assert parse_row(row("chunk", chunk))["key"] == chunk


@pytest.mark.parametrize("kind, under", [("tail", "chunk"), ("chunk", "tail")])
def test_a_row_under_the_other_kinds_key_is_dropped(kind, under):
    """A tail row filed under its chunk's key (or the reverse) would serve a tail's KV as a whole chunk."""
    assert parse_row(row(kind, expected_key(under, ROOT, TOKENS, True))) is None


def test_a_payload_name_must_sit_in_the_folder_of_its_keys_first_two_digits():
    key = chain_key(ROOT, TOKENS).hex()
    assert is_payload_name(f"payloads/{key[:2]}/{key}-0011aabb.kv", key)
    other = "00" if key[:2] != "00" else "11"
    assert not is_payload_name(f"payloads/{other}/{key}-0011aabb.kv", key)
    assert not is_payload_name(f"payloads/{other}/{key}-0011aabb.kv")
    assert parse_row(row("chunk", chain_key(ROOT, TOKENS), file=f"payloads/{other}/{key}-0011aabb.kv")) is None


def test_a_row_whose_tokens_or_parent_were_rewritten_is_dropped():
    key = chain_key(ROOT, TOKENS)
    other_tokens = np.asarray((5, 6, 7, 8, 9, 10, 11, 99), dtype="<i4").tobytes()
    assert parse_row(row("chunk", key, tokens=other_tokens)) is None
    assert parse_row(row("chunk", key, parent=("ab" * 16))) is None
    assert parse_row(row("chunk", key, exact=0)) is None  # an inexact entry lives under another key
