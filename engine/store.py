"""The chunk store: records (bookkeeping) apart from KV payloads (tensors), a byte budget, eviction.

Two kinds of entries:
- chunk: a complete chunk of a prompt, keyed by its chained prefix key; also indexed by content key.
- tail:  the tokens after the last complete chunk of a finished request (a partial chunk of the prompt and
         the generated answer), hung under the chained key of the chunk before it. The next turn of a
         conversation reuses the longest common token prefix of a tail (token-granular reuse).

A payload is the KV of a real prefill in the entry's true context: per layer (k, v), each [1, H_kv, T, D].
The store never computes anything; it holds, finds, counts and evicts.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .eviction import LRU, EvictionPolicy

KV = tuple[tuple[torch.Tensor, torch.Tensor], ...]

# Tokens per anchor for alignment-free lookup: any run of >= 2 * ANCHOR_LEN - 1 tokens shared with a stored chunk
# contains a whole anchor of it.
ANCHOR_LEN = 16


@dataclass
class ChunkRecord:
    key: bytes
    parent: bytes
    content_key: bytes | None
    kind: str  # "chunk" | "tail"
    start: int  # absolute token position of the first token
    tokens: tuple[int, ...]
    num_bytes: int
    importance: float = 0.0
    last_access: int = 0
    hits: int = 0
    ref_count: int = 0
    # False for KV computed after an APPROXIMATE segment: usable only for approximate reuse (anchors), never
    # under its chained key.
    exact: bool = True

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


@dataclass
class StoreCounters:
    hits: dict[str, int] = field(default_factory=lambda: {"EXACT": 0, "PREFIX": 0, "APPROXIMATE": 0})
    misses: int = 0
    stored: int = 0
    evicted: int = 0
    rejected: int = 0  # entries larger than the whole budget


def kv_nbytes(kv: KV) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)


def kv_importance(kv: KV) -> float:
    """Mean L2 norm of the value vectors over layers, heads and tokens (a cheap energy measure)."""
    norms = [v.float().norm(dim=-1).mean() for _, v in kv]
    return float(torch.stack(norms).mean()) if norms else 0.0


def default_budget_bytes(device: torch.device) -> int:
    """A quarter of free device memory on CUDA; on CPU a quarter of physical RAM, capped at 4 GiB."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * 0.25)
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 8 << 30
    return min(ram // 4, 4 << 30)


class ChunkStore:
    def __init__(self, budget_bytes: int, policy: EvictionPolicy | None = None):
        self.budget_bytes = budget_bytes
        self.policy = policy or LRU()
        self.records: dict[bytes, ChunkRecord] = {}
        self._payloads: dict[bytes, KV] = {}
        self._by_content: dict[bytes, set[bytes]] = {}
        self._tails_by_parent: dict[bytes, set[bytes]] = {}
        self._chunks_by_parent: dict[bytes, set[bytes]] = {}
        # Token anchors for alignment-free lookup: every ANCHOR_LEN tokens of every chunk, keyed by the token
        # tuple's hash, -> (chunk key, offset inside the chunk).
        self._anchors: dict[int, list[tuple[bytes, int]]] = {}
        self._clock = itertools.count(1)
        self.num_bytes = 0
        self.counters = StoreCounters()

    # -- lookup -------------------------------------------------------------------------------------------
    def get_chunk(self, key: bytes) -> ChunkRecord | None:
        record = self.records.get(key)
        if record is None or record.kind != "chunk" or not record.exact:
            return None
        return record

    def anchored(self, tokens: tuple[int, ...]) -> list[tuple[ChunkRecord, int]]:
        """Entries (chunks and tails) holding `tokens` (ANCHOR_LEN long) at an anchor offset, with the offset."""
        hits = self._anchors.get(hash(tokens), ())
        return [(self.records[key], offset) for key, offset in hits
                if self.records[key].tokens[offset:offset + ANCHOR_LEN] == tokens]

    def tails_under(self, parent: bytes) -> list[ChunkRecord]:
        return [self.records[k] for k in self._tails_by_parent.get(parent, ())]

    def children(self, parent: bytes) -> list[ChunkRecord]:
        """Chunks and tails stored right after the chunk `parent` (the text that followed it)."""
        keys = self._chunks_by_parent.get(parent, set()) | self._tails_by_parent.get(parent, set())
        return [self.records[k] for k in keys]

    def chunks_with_content(self, content_key: bytes) -> list[ChunkRecord]:
        return [self.records[k] for k in self._by_content.get(content_key, ())]

    def payload(self, key: bytes) -> KV:
        return self._payloads[key]

    def touch(self, record: ChunkRecord, kind: str) -> None:
        """Counts a hit of `kind` on `record` and refreshes its recency."""
        record.hits += 1
        record.last_access = next(self._clock)
        self.counters.hits[kind] += 1

    def acquire(self, record: ChunkRecord) -> None:
        record.ref_count += 1

    def release(self, record: ChunkRecord) -> None:
        assert record.ref_count > 0, "release without acquire"
        record.ref_count -= 1

    # -- insertion ----------------------------------------------------------------------------------------
    def put_chunk(self, key: bytes, parent: bytes, content_key: bytes, start: int, tokens: Sequence[int],
                  kv: KV, *, exact: bool = True) -> bool:
        if key in self.records:
            self.records[key].last_access = next(self._clock)
            return True
        record = ChunkRecord(key, parent, content_key, "chunk", start, tuple(tokens), kv_nbytes(kv), exact=exact)
        if not self._insert(record, kv):
            return False
        self._by_content.setdefault(content_key, set()).add(key)
        self._chunks_by_parent.setdefault(parent, set()).add(key)
        return True

    def put_tail(self, key: bytes, parent: bytes, start: int, tokens: Sequence[int], kv: KV) -> bool:
        """Stores a tail; tails under the same parent whose tokens are a prefix of this one are dropped,
        since this one serves every request they could."""
        tokens = tuple(tokens)
        if key in self.records:
            self.records[key].last_access = next(self._clock)
            return True
        for other in self.tails_under(parent):
            if other.ref_count == 0 and tokens[: other.num_tokens] == other.tokens:
                self._remove(other.key)
        record = ChunkRecord(key, parent, None, "tail", start, tokens, kv_nbytes(kv))
        if not self._insert(record, kv):
            return False
        self._tails_by_parent.setdefault(parent, set()).add(key)
        return True

    def _insert(self, record: ChunkRecord, kv: KV) -> bool:
        if record.num_bytes > self.budget_bytes or not self._make_room(record.num_bytes):
            self.counters.rejected += 1
            return False
        record.importance = kv_importance(kv)
        record.last_access = next(self._clock)
        self.records[record.key] = record
        # Python's hash of an int tuple is deterministic; the anchor index lives in memory only.
        for offset in range(0, record.num_tokens - ANCHOR_LEN + 1, ANCHOR_LEN):
            anchor = hash(record.tokens[offset:offset + ANCHOR_LEN])
            self._anchors.setdefault(anchor, []).append((record.key, offset))
        self._payloads[record.key] = kv
        self.num_bytes += record.num_bytes
        self.counters.stored += 1
        return True

    def _make_room(self, num_bytes: int) -> bool:
        if self.num_bytes + num_bytes <= self.budget_bytes:
            return True
        candidates = sorted((r for r in self.records.values() if r.ref_count == 0), key=self.policy.sort_key)
        for record in candidates:
            self._remove(record.key)
            self.counters.evicted += 1
            if self.num_bytes + num_bytes <= self.budget_bytes:
                return True
        return False

    def eviction_order(self) -> list[bytes]:
        """Keys in the order they would be evicted now (entries in use excluded)."""
        evictable = (r for r in self.records.values() if r.ref_count == 0)
        return [r.key for r in sorted(evictable, key=self.policy.sort_key)]

    def _remove(self, key: bytes) -> None:
        record = self.records.pop(key)
        assert record.ref_count == 0, "evicting an entry in use"
        del self._payloads[key]
        self.num_bytes -= record.num_bytes
        for offset in range(0, record.num_tokens - ANCHOR_LEN + 1, ANCHOR_LEN):
            anchor = hash(record.tokens[offset:offset + ANCHOR_LEN])
            remaining = [entry for entry in self._anchors.get(anchor, ()) if entry[0] != key]
            if remaining:
                self._anchors[anchor] = remaining
            else:
                self._anchors.pop(anchor, None)
        if record.kind == "chunk":
            indexes = ((self._by_content, record.content_key), (self._chunks_by_parent, record.parent))
        else:
            indexes = ((self._tails_by_parent, record.parent),)
        for index, bucket_key in indexes:
            bucket = index.get(bucket_key)
            if bucket is not None:
                bucket.discard(key)
                if not bucket:
                    del index[bucket_key]

    def clear(self) -> None:
        for key in [k for k, r in self.records.items() if r.ref_count == 0]:
            self._remove(key)

    def stats(self) -> dict:
        num_chunks = sum(1 for r in self.records.values() if r.kind == "chunk")
        return {
            "entries": len(self.records),
            "chunks": num_chunks,
            "tails": len(self.records) - num_chunks,
            "bytes": self.num_bytes,
            "budget_bytes": self.budget_bytes,
            "tokens": sum(r.num_tokens for r in self.records.values()),
            "hits": dict(self.counters.hits),
            "misses": self.counters.misses,
            "stored": self.counters.stored,
            "evicted": self.counters.evicted,
            "rejected": self.counters.rejected,
            "policy": self.policy.name,
        }
