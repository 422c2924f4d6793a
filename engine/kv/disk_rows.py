"""What the disk tier's index rows and payload file names may be, checked before anything is trusted.

Rows live in a SQLite file anyone may edit (by hand, by other software, by a vandal). A row is used only after
parse_row has checked every field's type and range, recomputed the entry's key from its parent and tokens (a row
whose tokens were rewritten names another key) and matched its file name against the pattern the tier itself
writes (payloads/<ab>/<key>-<nonce>.kv: never a path outside the folder). entry_fields is what a payload file's
header says it holds, checked against the row on every read (engine.kv.payload_file).
"""

from __future__ import annotations

import math
import re
import secrets

import numpy as np

from ..keys import KEY_BYTES, chain_key

_HEX_KEY = re.compile(r"[0-9a-f]{%d}" % (2 * KEY_BYTES))
_PAYLOAD_NAME = re.compile(r"payloads/([0-9a-f]{2})/([0-9a-f]{%d})-[0-9a-f]{8}\.kv" % (2 * KEY_BYTES))
_TMP_NAME = re.compile(r"tmp/[0-9a-f]{%d}-[0-9a-f]{8}\.kv\.\d+\.tmp" % (2 * KEY_BYTES))
MAX_ROW_TOKENS = 1 << 20


def payload_name(key_hex: str) -> str:
    """A fresh relative file name for an entry's payload (unique per write)."""
    return f"payloads/{key_hex[:2]}/{key_hex}-{secrets.token_hex(4)}.kv"


def is_payload_name(file, key_hex: str | None = None) -> bool:
    """Whether `file` (from an index row) is a name this tier writes, for entry `key_hex` when given."""
    if not isinstance(file, str):
        return False
    match = _PAYLOAD_NAME.fullmatch(file)
    if match is None or match.group(1) != match.group(2)[:2]:
        return False
    return key_hex is None or match.group(2) == key_hex


def expected_key(kind: str, parent: bytes, tokens, exact: bool) -> bytes:
    """The key an entry of this kind, parent and tokens is stored under (engine.reuse: store_chunks, store_tail)."""
    if kind == "tail":
        return chain_key(parent + b"tail", tokens)
    key = chain_key(parent, tokens)
    return key if exact else chain_key(key + b"inexact", [])


def parse_row(row: dict) -> dict | None:
    """An index row with its fields checked and decoded (key/parent/content_key as bytes, tokens as a tuple),
    or None when anything about it is wrong: a bad row is dropped, never trusted and never an exception."""
    try:
        key_hex, parent_hex, kind = row["key"], row["parent"], row["kind"]
        if not (isinstance(key_hex, str) and _HEX_KEY.fullmatch(key_hex)):
            return None
        if not (isinstance(parent_hex, str) and _HEX_KEY.fullmatch(parent_hex)) or kind not in ("chunk", "tail"):
            return None
        content = row["content_key"]
        if kind == "chunk" and not (isinstance(content, str) and _HEX_KEY.fullmatch(content)):
            return None
        blob = row["tokens"]
        if not isinstance(blob, bytes) or not blob or len(blob) % 4 or len(blob) > 4 * MAX_ROW_TOKENS:
            return None
        tokens = tuple(int(t) for t in np.frombuffer(blob, dtype="<i4"))
        ints = [row[name] for name in ("id", "start", "exact", "num_bytes", "raw_bytes", "hits", "lossy")]
        if any(isinstance(v, bool) or not isinstance(v, int) for v in ints):
            return None
        row_id, start, exact, num_bytes, raw_bytes, hits, lossy = ints
        importance = row["importance"]
        if isinstance(importance, bool) or not isinstance(importance, (int, float)) or not math.isfinite(importance):
            return None
        if start < 0 or num_bytes <= 0 or raw_bytes <= 0 or hits < 0 or exact not in (0, 1) or lossy not in (0, 1):
            return None
        if min(tokens) < 0 or (kind == "tail" and not exact):
            return None
        parent = bytes.fromhex(parent_hex)
        key = bytes.fromhex(key_hex)
        if key != expected_key(kind, parent, tokens, bool(exact)):
            return None  # tokens or parent rewritten: the row does not describe its own key
        if "file" in row and not is_payload_name(row["file"], key_hex):
            return None
    except (KeyError, TypeError, ValueError, OverflowError):
        return None
    return {"id": row_id, "key": key, "parent": parent, "content_key": bytes.fromhex(content) if content else None,
            "kind": kind, "start": start, "tokens": tokens, "exact": bool(exact), "num_bytes": num_bytes,
            "raw_bytes": raw_bytes, "importance": float(importance), "hits": hits, "lossy": bool(lossy),
            "file": row.get("file")}


def entry_fields(record, lossy: bool) -> dict:
    """What a payload file says it is the KV of (checked on every read against the row and the prompt)."""
    return {"kind": record.kind, "parent": record.parent.hex(), "start": record.start,
            "tokens": [int(t) for t in record.tokens], "exact": bool(record.exact), "lossy": bool(lossy)}
