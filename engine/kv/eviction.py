"""Eviction policies: each is a sort key over entries; the lowest key is evicted first.

Policies read only what the Ranked protocol names (recency, hit count, importance), so the store's records and
the disk index's rows are ranked the same way. An entry in use (ref_count > 0) is never evicted; the store
enforces that, policies only order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Sequence, TypeVar


class Ranked(Protocol):
    """What a policy reads of an entry."""

    last_access: int  # a logical clock, one tick per store operation
    hits: int
    importance: float


@dataclass
class Candidate:
    """An entry known only by its bookkeeping (a disk index row), with what it stands for in `ref`."""

    last_access: int
    hits: int
    importance: float
    ref: object = None


R = TypeVar("R", bound=Ranked)


class EvictionPolicy(Protocol):
    name: str

    def sort_key(self, record: Ranked) -> tuple: ...


def rank(policy: EvictionPolicy, records: Sequence[R]) -> list[R]:
    """`records` in eviction order (first out first). Policies with a `rescale(records)` see the competitors
    first."""
    records = list(records)
    if hasattr(policy, "rescale"):
        policy.rescale(records)
    return sorted(records, key=policy.sort_key)


class LRU:
    """Least recently used first."""

    name = "lru"

    def sort_key(self, record: Ranked) -> tuple:
        return (record.last_access,)


class ImportanceLRU:
    """Recency, extended by hit count and importance: an entry hit h times is kept as if it had been touched
    `hit_weight * log1p(h) * N` store operations later, N being the number of entries competing for the tier
    (so the bonus means the same in a store of 16 entries and of 16,000), scaled by its importance relative to
    the mean of the competitors (importance = mean L2 norm of the entry's key and value vectors, so KV with
    more energy survives longer). `last_access` is a logical clock, one tick per store operation.
    hit_weight was picked on a skewed trace (bench/kv_tiers.py, docs/benchmarks.md)."""

    name = "importance-lru"

    def __init__(self, hit_weight: float = 2.0):
        self.hit_weight = hit_weight
        self._scale = 1.0
        self._mean_importance = 0.0

    def rescale(self, records: Sequence[Ranked]) -> None:
        """Called by the store with the entries about to be ranked, before sort_key."""
        self._scale = float(len(records))
        self._mean_importance = sum(r.importance for r in records) / len(records) if records else 0.0

    def sort_key(self, record: Ranked) -> tuple:
        relative = record.importance / self._mean_importance if self._mean_importance > 0 else 1.0
        bonus = self.hit_weight * math.log1p(record.hits) * self._scale * relative
        return (record.last_access + bonus, record.last_access)


POLICIES = {"lru": LRU, "importance-lru": ImportanceLRU}
