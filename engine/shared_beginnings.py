"""Requests of one batched step that begin alike read one copy of their beginning (engine.block_forward).

A document asked about in several conversations, or one system prompt for every client of a server, puts requests
in one step whose caches begin with the same tokens and, by the reuse promise, the same bits. Where two caches hold
the very same bits in at least their first SHARE_FROM positions, the later request's attention reads those keys and
values where the earlier one has just read them, not its own copy from memory: the bits are the same, and so is
every answer. Comparing is the cost, so each pair's result is remembered while neither cache rewrites a position.
"""

from __future__ import annotations

import ctypes
import weakref

from .live_cache import GrowingCache
from .weights import gguf_blocks

# Positions two requests of a step must begin with alike before one reads the other's keys and values (a chat
# template's first tokens are not worth the comparisons)
SHARE_FROM = 64


class SharedBeginnings:
    """What one model's steps found alike, and how many of its forwards shared a beginning (`forwards`)."""

    def __init__(self):
        self.forwards = 0
        # a cache b -> {id of another, a: (a weak reference to a, both caches' rewrites, how many crops each had,
        # positions alike, positions compared)} (_alike)
        self._memo: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def leads(self, caches: list[GrowingCache], starts: list[int], n_layers: int, arrays: list) -> tuple:
        """For each request of a step, an earlier one whose cache holds the very same bits in at least its first
        SHARE_FROM positions, and how many: (lead, shared) as the C call takes them, or (None, None) where no
        request has one. A request is compared with the requests before it that read their own (theirs: the same
        bits again). `arrays`: each cache's buffers as the C call takes them."""
        lead, shared = [0] * len(caches), [0] * len(caches)
        rewrites: list = [None] * len(caches)  # each cache's, counted once a step
        for s in range(1, len(caches)):
            for r in range(s):
                limit = min(starts[r], starts[s])
                if shared[r] == 0 and limit >= max(SHARE_FROM, shared[s] + 1):
                    for i in (r, s):
                        rewrites[i] = caches[i].rewrites(n_layers) if rewrites[i] is None else rewrites[i]
                    alike = self._alike(caches[r], caches[s], arrays[r], arrays[s], (rewrites[r], rewrites[s]),
                                        limit, n_layers)
                    if alike >= SHARE_FROM and alike > shared[s]:
                        lead[s], shared[s] = r, alike
        if not any(shared):
            return None, None
        self.forwards += 1
        return (ctypes.c_int64 * len(caches))(*lead), (ctypes.c_int64 * len(caches))(*shared)

    def _alike(self, a: GrowingCache, b: GrowingCache, a_array, b_array, rewrites: tuple, limit: int,
               n_layers: int) -> int:
        """How many of their first `limit` positions caches `a` and `b` hold alike in every bit of every layer
        (kvb_same_until over their buffers). Remembered for the pair while neither has rewritten a position
        (`rewrites`: GrowingCache.rewrites of both); a crop since lowers what was compared to where it cut
        (GrowingCache.crops). So a pair is compared in full once, then only over positions it did not hold."""
        memo = self._memo.setdefault(b, {})
        known = memo.get(id(a))
        alike = compared = 0
        if known is not None and known[0]() is a and known[1] == rewrites:
            cut = min(a.crops[known[2]:] + b.crops[known[3]:], default=known[5])
            compared = min(known[5], cut)
            alike = min(known[4], compared)
        if alike == compared and limit > compared:
            layer = a.layers[0]
            alike = gguf_blocks.library().kvb_same_until(ctypes.addressof(a_array), ctypes.addressof(b_array),
                                                         n_layers, layer.keys.shape[1], layer.keys.shape[3],
                                                         compared, limit)
            compared = limit
        memo[id(a)] = (weakref.ref(a), rewrites, len(a.crops), len(b.crops), alike, compared)
        return min(alike, limit)
