"""Reuse around one request: plan the prompt against the store, fetch what the plan reuses, release it after,
and store what the request computed (its new complete chunks, then its tail) for later requests.

Every entry a plan reuses is acquired (ref_count > 0: never evicted or moved) from the fetch until `release`,
which the caller runs however the request ends. Stored KV is copied out of the live cache (engine.paged.kv_range,
spilled pages included): a view would pin the whole cache tensor in memory and defeat the store's byte budget.

With a remote tier (engine.kv.remote_tier), the prompt's complete chunks that no local tier holds are asked of it
before planning (one pipelined round trip); what it holds comes into the memory tiers, is reported as served from
"remote" and gets its disk copy with the request's new chunks, after the first token (never a copy back to the
store it came from). How long that read may take follows what it saves: each request's prefill is timed, from the
end of its fetch to the storing of its chunks after the first token, and its rate (computed tokens per second)
given to the remote tier (RemoteTier.observe_prefill).
"""

from __future__ import annotations

import time

from .approx import apply_selective, fill_approximate, merge_misses
from .chunking import TokenBreaks, chunk_spans
from .config import ChunkingConfig, RepairConfig
from .keys import chain_key, content_key
from .kv.records import ChunkRecord
from .kv.remote_tier import RemoteEntry
from .kv.store import ChunkStore
from .kv.tiers import decode_kv
from .paged import kv_range
from .plan import EXACT, MISS, PREFIX, QUANTIZED, Plan, Segment, chain_keys, plan_prompt

# Below this share of the prompt, reuse costs more than it saves (see KVReuse.plan).
MIN_REUSE_FRACTION = 0.25


class KVReuse:
    """The store seen by requests: what a prompt can reuse, and what a finished prefill adds."""

    def __init__(self, store: ChunkStore, root: bytes, chunking: ChunkingConfig, breaks: TokenBreaks,
                 repair: RepairConfig, rope=None):
        self.store = store
        self.root = root  # the parent of every prompt's first chunk (weights, dtype and chunking in one key)
        self.chunking = chunking
        self.breaks = breaks
        self.rope = rope  # RoPE parameters for re-rotation (reuse="approx"), else None
        self.repair = repair
        self._fetched_at: dict[int, tuple[float, int]] = {}  # id(plan) -> (when its fetch ended, tokens to compute)

    def plan(self, ids: list[int], mode: str) -> Plan:
        """Which token ranges of `ids` are reused from which entry (mode "off" | "prefix" | "chunk" | "approx")."""
        spans, num_complete = chunk_spans(ids, self.chunking, self.breaks)
        plan = self._plan_reuse(ids, spans, num_complete, mode)
        if 0 < plan.reused_tokens < MIN_REUSE_FRACTION * len(ids):
            # Attention over a cached past runs with an explicit mask, which on CPU costs about twice the
            # causal fast path (measured: 68 vs 36 ms per layer, 1945 queries over 1980 keys): reusing a small
            # part of a long prompt is slower than not reusing it.
            plan = plan_prompt(ids, spans, num_complete, self.root, self.store, "off")
        return plan

    def _plan_reuse(self, ids, spans, num_complete, mode):
        if mode != "approx":
            return plan_prompt(ids, spans, num_complete, self.root, self.store, mode)
        repair = self.repair

        def approximate(segments):
            segments = fill_approximate(merge_misses(segments), ids, self.store, self.rope)
            if repair.mode == "selective":
                segments = apply_selective(segments, repair.selective_tokens, repair.selective_before)
            elif repair.mode == "cacheblend" and repair.blend_seam_tokens:
                # Seam tokens become computed tokens, which the blend pass always recomputes.
                segments = apply_selective(segments, repair.blend_seam_tokens)
            return segments

        return plan_prompt(ids, spans, num_complete, self.root, self.store, "chunk", refine=approximate)

    def plan_and_fetch(self, ids: list[int], mode: str) -> tuple[Plan, dict[str, int]]:
        """The plan, with every entry it reuses acquired and its payload on the device. An entry whose disk
        payload turns out missing, corrupt or not the KV of the tokens it would serve is dropped and the prompt
        planned again without it (its text becomes a MISS and is computed and stored afresh). Hits served
        lossy values are relabelled QUANTIZED. Returns the plan and reused tokens per tier served from."""
        store = self.store
        if mode != "off":
            store.sync_disk()  # entries other processes wrote since the last request
        restored = self.restore_remote(ids) if mode != "off" and store.remote is not None else set()
        served_from: dict[bytes, tuple[str, bool]] = {}  # where each entry was before any fetch moved it
        while True:
            plan = self.plan(ids, mode)
            records = list({id(record): record for _, record in _reused(plan)}.values())
            for record in records:
                tier = "remote" if record.key in restored else record.tier
                served_from.setdefault(record.key, (tier, store.served_lossy(record)))
            for _, record in _reused(plan):
                store.acquire(record)
            try:
                bad = [r for r in records if not store.fetch(r)]
            except BaseException:  # e.g. out of device memory while promoting: nothing stays acquired
                self.release(plan)
                raise
            bad += [record for seg, record in _reused(plan)
                    if all(r is not record for r in bad) and not _serves_its_tokens(seg, ids)]
            if not bad:
                break
            self.release(plan)
            for record in bad:
                served_from.pop(record.key, None)
                store.drop(record)
        store.counters.misses += sum(1 for s in plan.segments if s.kind == MISS)
        reused_by_tier: dict[str, int] = {}
        for seg, record in _reused(plan):
            tier, lossy = served_from[record.key]
            if lossy and seg.kind in (EXACT, PREFIX):
                seg.kind = QUANTIZED
            store.touch(record, seg.kind, tier)
            reused_by_tier[tier] = reused_by_tier.get(tier, 0) + seg.num_tokens
        store.touch_disk(records)
        computed = len(ids) - plan.reused_tokens
        if store.remote is not None and computed >= self.chunking.size:  # shorter ones time overheads, not prefill
            self._fetched_at[id(plan)] = (time.perf_counter(), computed)
        return plan, reused_by_tier

    def restore_remote(self, ids: list[int]) -> set[bytes]:
        """Brings the prompt's complete chunks that only the remote tier holds into the local tiers; returns
        their keys. A value the remote cannot serve (absent, evicted, corrupt, the store down) is simply not
        there: its text is computed, and stored everywhere afresh."""
        store = self.store
        spans, num_complete = chunk_spans(ids, self.chunking, self.breaks)
        keys = chain_keys(ids, spans, num_complete, self.root)
        wanted = [RemoteEntry(keys[i], keys[i - 1] if i else self.root, spans[i][0],
                              tuple(ids[spans[i][0]:spans[i][1]]))
                  for i in range(num_complete) if keys[i] not in store.records]
        found = store.remote.get_many(wanted)
        restored = set()
        for entry in wanted:
            stored = found.get(entry.key)
            if stored is None:
                continue
            kv = decode_kv(stored, store.device)
            if store.put_chunk(entry.key, entry.parent, content_key(self.root.hex(), entry.tokens), entry.start,
                               entry.tokens, kv, lossy=stored.quant != "none", share=False, disk=False):
                restored.add(entry.key)
        return restored

    def release(self, plan: Plan) -> None:
        """Undoes the acquisitions of `plan_and_fetch` (one per reuse segment)."""
        self._fetched_at.pop(id(plan), None)
        for _, record in _reused(plan):
            self.store.release(record)

    def store_chunks(self, plan: Plan, cache) -> int:
        """Stores every complete chunk of the prompt that is not in the store yet, from the prefill's own KV.

        A chunk that starts at or after the first APPROXIMATE token holds approximate KV: it is stored for
        approximate reuse only (never under its chained key), and only if part of it was computed here (a chunk
        served wholly from another entry would just duplicate it). A chunk ending after the first QUANTIZED
        token is stored as lossy (its hits are QUANTIZED). Returns the number stored."""
        store = self.store
        fetched = self._fetched_at.pop(id(plan), None)
        if fetched is not None:  # the prefill (and the first token) ran since the fetch
            store.remote.observe_prefill(fetched[1], time.perf_counter() - fetched[0])
        stored = 0
        first_approx = plan.first_approximate
        first_lossy = plan.first_lossy
        for index in range(plan.num_complete):
            key = plan.keys[index]
            start, end = plan.spans[index]
            exact = end <= first_approx
            if exact and store.get_chunk(key) is not None:
                continue
            if not exact:
                if not any(s.kind == MISS and s.start < end and s.end > start for s in plan.segments):
                    continue
                key = chain_key(key + b"inexact", [])
                if key in store.records:
                    continue
            tokens = plan.ids[start:end]
            if store.put_chunk(key, plan.parent_of(index), content_key(self.root.hex(), tokens), start, tokens,
                               kv_range(cache, start, end), exact=exact, lossy=first_lossy < end):
                stored += 1
        # Chunks restored from the remote tier came into memory only (a disk write before the prefill would
        # delay the first token); now they get their disk copy too.
        for key in plan.keys:
            record = store.records.get(key)
            if record is not None and not record.on_disk:
                store.write_through(record)
        return stored

    def store_tail(self, plan: Plan, cache, ids: list[int]) -> None:
        """The KV after the last complete chunk (partial chunk + answer), for the next turn's token-level
        reuse; `ids` is the prompt and the answer. The last sampled token was never fed to the model, so the
        KV ends one before it. Not stored when the prompt had APPROXIMATE hits: tails serve exact
        continuations only."""
        end = cache.get_seq_length()
        start = plan.tail_start
        if end <= start or plan.first_approximate < len(plan.ids):
            return
        tokens = ids[start:end]
        key = chain_key(plan.tail_parent + b"tail", tokens)
        if self.store.refresh(key):  # the same tokens after the same chunks: the same KV, stored (no copy made)
            return
        self.store.put_tail(key, plan.tail_parent, start, tokens, kv_range(cache, start, end),
                            lossy=plan.first_lossy < end)


def _reused(plan: Plan) -> list[tuple[Segment, ChunkRecord]]:
    """Each reuse segment of `plan` with the entry it reads (an entry appears once per segment using it)."""
    return [(seg, seg.record) for seg in plan.segments if seg.record is not None]


def _serves_its_tokens(seg: Segment, ids: list[int]) -> bool:
    """Whether the entry a segment reuses holds the very tokens of the prompt there (it always should; this is
    the last check before reuse, against entries whose bookkeeping was changed behind the store's back)."""
    record = seg.record
    return tuple(ids[seg.start:seg.end]) == record.tokens[seg.offset:seg.offset + seg.num_tokens]

