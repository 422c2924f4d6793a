"""Eviction policies: each is a sort key over chunk records; the lowest key is evicted first.

An entry in use (ref_count > 0) is never evicted; the store enforces that, policies only order.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .store import ChunkRecord


class EvictionPolicy(Protocol):
    name: str

    def sort_key(self, record: ChunkRecord) -> tuple: ...


class LRU:
    """Least recently used first."""

    name = "lru"

    def sort_key(self, record: ChunkRecord) -> tuple:
        return (record.last_access,)


class ImportanceLRU:
    """Recency weighted by importance and hit count: an entry that many requests hit, or whose KV carries
    more energy, survives longer than one touched as recently. `last_access` is a logical clock (one tick per
    store operation), so the weight is in units of "how many operations later it is worth keeping"."""

    name = "importance-lru"

    def __init__(self, hit_weight: float = 4.0, importance_weight: float = 2.0):
        self.hit_weight = hit_weight
        self.importance_weight = importance_weight

    def sort_key(self, record: ChunkRecord) -> tuple:
        bonus = self.hit_weight * math.log1p(record.hits) + self.importance_weight * record.importance
        return (record.last_access + bonus, record.last_access)


POLICIES = {"lru": LRU, "importance-lru": ImportanceLRU}
