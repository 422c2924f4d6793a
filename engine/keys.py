"""Chunk keys: a chained prefix hash (EXACT hits) and a position-free content hash (APPROXIMATE hits).

Both start from the engine fingerprint (weights, dtype, RoPE and chunking config), so keys never cross
models or settings. blake2b over little-endian int32 token ids: deterministic across processes and
machines, unlike hash().
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

KEY_BYTES = 16


def _token_bytes(tokens: Sequence[int]) -> bytes:
    return np.asarray(tokens, dtype="<i4").tobytes()


def root_key(fingerprint: str) -> bytes:
    """The parent of the first chunk of every prompt."""
    return hashlib.blake2b(b"kvboost-root\0" + fingerprint.encode(), digest_size=KEY_BYTES).digest()


def chain_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Key of a chunk given its parent's key: equal iff every token before and in the chunk is equal."""
    h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
    h.update(_token_bytes(tokens))
    return h.digest()


def content_key(fingerprint: str, tokens: Sequence[int]) -> bytes:
    """Key of a chunk's tokens alone, wherever they sit in a prompt."""
    h = hashlib.blake2b(b"kvboost-content\0" + fingerprint.encode() + b"\0", digest_size=KEY_BYTES)
    h.update(_token_bytes(tokens))
    return h.digest()
