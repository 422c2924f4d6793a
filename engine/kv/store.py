"""The chunk store: records (bookkeeping) apart from KV payloads (tensors), a byte budget, eviction.

Two kinds of entries:
- chunk: a complete chunk of a prompt, keyed by its chained prefix key; also indexed by content key.
- tail:  the tokens after the last complete chunk of a finished request (a partial chunk of the prompt and
         the generated answer), hung under the chained key of the chunk before it. The next turn of a
         conversation reuses the longest common token prefix of a tail (token-granular reuse).

A payload is the KV of a real prefill in the entry's true context: per layer (k, v), each [1, H_kv, T, D].
The store never computes anything; it holds, finds, counts, moves between tiers and evicts.

Tiers (engine.kv.tiers, engine.kv.disk): every record lives in the fastest tier holding its payload (`record.tier`):
"device" (where the model runs), "host" (RAM; pinned under a GPU), "disk" (files shared by processes, kept
across restarts). A tier over its budget demotes its policy's first victims one tier down (device -> host ->
disk -> gone); a hit promotes the entry back to the device (engine.reuse fetches before computing). With a
disk tier every new entry is also written through to disk, so what was computed survives a restart. Entries
in use (ref_count > 0) never move or leave. Below disk, a remote tier (engine.kv.remote_tier) shared by machines
gets a copy of every exact chunk with its computed values; engine.reuse reads it back into these tiers. What
comes back from disk or the remote tier is used only when it is the model's KV (engine.kv.tiers.KVLayout).

Over 400 lines on purpose: the records' indexes (chained key, content key, anchors, children) and their moves
between tiers change together under one rule (an entry in use never moves); split, every move would reach into
another module's dictionaries. What a record holds and what the store counts are in engine.kv.records.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import torch

from .eviction import LRU, EvictionPolicy, rank
from .records import ChunkRecord, StoreCounters, kv_importance, kv_nbytes
from .tiers import KV, KVLayout, MemoryTier, decode_kv, encode_kv

# Tokens per anchor for alignment-free lookup: any run of >= 2 * ANCHOR_LEN - 1 tokens shared with a stored chunk
# contains a whole anchor of it.
ANCHOR_LEN = 16


def _checked(stored, record: ChunkRecord, device: torch.device, layout: KVLayout | None, quant: str) -> KV | None:
    """A disk payload as KV on the device, or None when it is not this model's KV of the entry's tokens (the
    file's checksum covers its header, not who wrote it). The remote tier checks its values the same way."""
    layout = layout or KVLayout.of_stored(stored)
    if layout is None or layout.mismatch(stored, quant, record.num_tokens) is not None:
        return None
    try:
        kv = decode_kv(stored, device)
    except (RuntimeError, ValueError, AssertionError, IndexError):
        return None
    if not kv or any(k.shape[2] != record.num_tokens or v.shape[2] != record.num_tokens for k, v in kv):
        return None
    return kv if kv_nbytes(kv) == record.num_bytes else None


class ChunkStore:
    def __init__(self, budget_bytes: int, policy: EvictionPolicy | None = None, *,
                 device: torch.device | str = "cpu", device_quant: str = "none", host: MemoryTier | None = None,
                 disk=None, remote=None, layout: KVLayout | None = None, budget_rule: str | None = None):
        """`budget_bytes`: the device tier's budget (`budget_rule`: where it came from, as the reports show it).
        Optional lower tiers: `host` (MemoryTier), `disk` (engine.kv.disk.DiskTier), `remote`
        (engine.kv.remote_tier.RemoteTier: shared by machines, read by engine.reuse). `layout`: the model's KV,
        which payloads read back must have (corrected by the first KV stored)."""
        self.device = torch.device(device)
        self.layout = layout
        self.policy = policy or LRU()
        self.device_tier = MemoryTier("device", budget_bytes, self.device, device_quant, budget_rule=budget_rule)
        self.host_tier = host
        self.memory_tiers = [t for t in (self.device_tier, host) if t is not None]
        self.disk = disk
        self.remote = remote
        self._unpersisted: set[bytes] = set()  # put with disk=False, not yet given to write_through
        self.records: dict[bytes, ChunkRecord] = {}
        self._staged: dict[bytes, KV] = {}  # payloads fetched for requests in flight that no tier could keep
        self._in_use: set[bytes] = set()  # keys with ref_count > 0 (the disk tier must not evict them)
        self._by_content: dict[bytes, set[bytes]] = {}
        self._tails_by_parent: dict[bytes, set[bytes]] = {}
        self._chunks_by_parent: dict[bytes, set[bytes]] = {}
        # Token anchors for alignment-free lookup: every ANCHOR_LEN tokens of every chunk, keyed by the token
        # tuple's hash, -> (chunk key, offset inside the chunk).
        self._anchors: dict[int, list[tuple[bytes, int]]] = {}
        self._clock = itertools.count(1)
        self._disk_seen = 0  # highest disk index row id loaded
        self.counters = StoreCounters()
        self.sync_disk()

    @property
    def budget_bytes(self) -> int:
        return self.device_tier.budget_bytes

    @property
    def num_bytes(self) -> int:
        return self.device_tier.num_bytes

    # -- lookup (engine.plan.ChunkLookup) --------------------------------------------------------------------
    def record(self, key: bytes) -> ChunkRecord | None:
        return self.records.get(key)

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
        """The entry's KV on the device. For an entry below the device tier, call fetch() first."""
        if key in self.device_tier:
            return self.device_tier.get(key, self.device)
        if key in self._staged:
            return self._staged[key]
        record = self.records[key]
        assert record.tier == "host", f"payload of a {record.tier} entry without fetch()"
        return self.host_tier.get(key, self.device)

    def touch(self, record: ChunkRecord, kind: str, tier: str | None = None) -> None:
        """Counts a hit of `kind` on `record`, served from `tier` (default: where it is), and refreshes its
        recency."""
        record.hits += 1
        record.last_access = next(self._clock)
        self.counters.hits[kind] += 1
        self.counters.tier_hits[tier or record.tier] += 1

    def served_lossy(self, record: ChunkRecord) -> bool:
        """Whether a hit on `record` now would be served values that are not the computed ones."""
        return record.disk_lossy if record.tier == "disk" and record.key not in self._staged else record.lossy

    def acquire(self, record: ChunkRecord) -> None:
        record.ref_count += 1
        self._in_use.add(record.key)

    def release(self, record: ChunkRecord) -> None:
        assert record.ref_count > 0, "release without acquire"
        record.ref_count -= 1
        if record.ref_count == 0:
            self._in_use.discard(record.key)
            self._staged.pop(record.key, None)

    # -- tiers ----------------------------------------------------------------------------------------------
    def fetch(self, record: ChunkRecord) -> bool:
        """Makes an acquired entry's payload available on the device, promoting it there when the device tier
        has room. False when its disk payload is missing or corrupt: the caller releases it, drop()s it and
        plans again (its text is then a MISS, and computing it again stores a good copy)."""
        assert record.ref_count > 0, "fetch of an entry not acquired"
        if record.tier == "device" or record.key in self._staged:
            return True
        lossy = record.lossy
        if record.tier == "host":
            kv = self.host_tier.get(record.key, self.device)
            loaded = None
        else:
            loaded = self.disk.load(record.key, record)
            kv = _checked(loaded, record, self.device, self.layout, self.disk.quant) if loaded is not None else None
            if kv is None:  # missing, corrupt or not this entry's: the caller drops the record
                if loaded is not None:
                    self.disk.remove([record.key])
                self.counters.disk_misses += 1
                record.on_disk = False
                return False
            lossy = record.disk_lossy
        if loaded is not None and loaded.quant == self.device_tier.quant == "none" and self.device.type == "cpu":
            stored = loaded  # views of the one buffer the file was read into: no copy
        else:
            stored = self.device_tier.encode(kv)
        if self._make_room(0, stored.nbytes):
            if record.tier == "host":
                self.host_tier.remove(record.key)
            self.device_tier.put(record.key, stored)
            record.tier = "device"
            record.lossy = lossy or self.device_tier.quant != "none"
            self.counters.promoted += 1
        else:  # no room next to the entries in use: this request keeps its own copy until release
            self._staged[record.key] = kv
        return True

    def drop(self, record: ChunkRecord) -> None:
        """Forgets an entry whose payload could not be fetched (not in use any more)."""
        if record.key in self.records:
            self._remove(record.key)

    def sync_disk(self) -> int:
        """Loads the records of disk entries added since the last sync (by this or another process)."""
        if self.disk is None:
            return 0
        added = 0
        for row in self.disk.rows_since(self._disk_seen):  # rows checked by engine.kv.disk.parse_row
            self._disk_seen = max(self._disk_seen, row["id"])
            key = row["key"]
            known = self.records.get(key)
            if known is not None:
                if known.tokens == row["tokens"] and known.kind == row["kind"]:
                    known.on_disk = True
                    known.disk_lossy = row["lossy"] or self.disk.quant != "none"
                continue
            record = ChunkRecord(key, row["parent"], row["content_key"], row["kind"], row["start"], row["tokens"],
                                 row["raw_bytes"], importance=row["importance"], last_access=next(self._clock),
                                 hits=row["hits"], exact=row["exact"], tier="disk", on_disk=True,
                                 disk_lossy=row["lossy"] or self.disk.quant != "none")
            self._index(record)
            added += 1
        return added

    def touch_disk(self, records) -> None:
        """Recency and hit counts of entries used by a request, in the shared disk index (one transaction)."""
        if self.disk is not None:
            self.disk.touch([r.key for r in records if r.on_disk])

    # -- insertion ----------------------------------------------------------------------------------------
    def put_chunk(self, key: bytes, parent: bytes, content_key: bytes, start: int, tokens: Sequence[int],
                  kv: KV, *, exact: bool = True, lossy: bool = False, share: bool = True, disk: bool = True) -> bool:
        """`lossy`: `kv` was computed over quantized KV (its values are not those of a full prefill). `share`:
        also written to the remote tier (False for what was just read from it). `disk` False: not written
        through to disk now (write_through does it later, off the time to first token)."""
        if key in self.records:
            self.records[key].last_access = next(self._clock)
            return True
        record = ChunkRecord(key, parent, content_key, "chunk", start, tuple(tokens), kv_nbytes(kv), exact=exact,
                             lossy=lossy)
        return self._insert(record, kv, share, disk)

    def refresh(self, key: bytes) -> bool:
        """Whether an entry is stored under `key`; if so it counts as used now, as storing it again would make it."""
        record = self.records.get(key)
        if record is None:
            return False
        record.last_access = next(self._clock)
        return True

    def put_tail(self, key: bytes, parent: bytes, start: int, tokens: Sequence[int], kv: KV, *,
                 lossy: bool = False) -> bool:
        """Stores a tail; tails under the same parent whose tokens are a prefix of this one are dropped,
        since this one serves every request they could."""
        tokens = tuple(tokens)
        if self.refresh(key):
            return True
        shorter = [other for other in self.tails_under(parent)
                   if other.ref_count == 0 and tokens[: other.num_tokens] == other.tokens]
        record = ChunkRecord(key, parent, None, "tail", start, tokens, kv_nbytes(kv), lossy=lossy)
        if not self._insert(record, kv):
            return False
        for other in shorter:
            self._remove(other.key)
        if self.disk is not None:
            self.disk.remove([r.key for r in shorter if r.on_disk])
        return True

    def _insert(self, record: ChunkRecord, kv: KV, share: bool = False, disk: bool = True) -> bool:
        seen = KVLayout.of_kv(kv)
        if seen != self.layout:  # the config described the model's KV wrongly: what it computes is the truth
            self.layout = seen
            if self.remote is not None:
                self.remote.layout = seen
        record.importance = kv_importance(kv)
        record.last_access = next(self._clock)
        computed_lossy = record.lossy
        placed = False
        for level, tier in enumerate(self.memory_tiers):
            stored = tier.encode(kv)
            if stored.nbytes <= tier.budget_bytes and self._make_room(level, stored.nbytes):
                tier.put(record.key, stored)
                record.tier = tier.name
                record.lossy = computed_lossy or tier.quant != "none"
                placed = True
                break
        if self.disk is not None and not disk:
            self._unpersisted.add(record.key)
        elif self.disk is not None:
            self._write_disk(record, kv, computed_lossy)
            if not placed and record.on_disk:
                record.tier = "disk"
                placed = True
        if not placed:
            self.counters.rejected += 1
            return False
        if share and self.remote is not None and record.exact and not computed_lossy:
            # Queued for a background thread; only exact chunks with the computed values leave the machine.
            self.remote.put(record, encode_kv(kv, self.remote.quant, torch.device("cpu")))
        self._index(record)
        self.counters.stored += 1
        return True

    def _write_disk(self, record: ChunkRecord, kv: KV, lossy: bool) -> None:
        """Writes `kv` (lossy: its values are not the computed ones) as the entry's disk copy."""
        stored = self.disk_encode(kv)
        disk_lossy = lossy or self.disk.quant != "none"
        lost = self.disk.put(record, stored, self._in_use, lossy=disk_lossy)
        if lost is None:
            return
        record.on_disk = True
        record.disk_lossy = disk_lossy
        for key in lost:
            other = self.records.get(key)
            if other is None:
                continue
            other.on_disk = False
            if other.tier == "disk":
                self._remove(key)
                self.counters.evicted += 1

    def write_through(self, record: ChunkRecord) -> None:
        """Writes the disk copy of an entry held only in memory (one put with disk=False)."""
        if record.key not in self._unpersisted:
            return
        self._unpersisted.discard(record.key)
        if not record.on_disk and record.tier in ("device", "host"):
            tier = self.device_tier if record.tier == "device" else self.host_tier
            self._write_disk(record, tier.get(record.key, torch.device("cpu")), record.lossy)

    def disk_encode(self, kv: KV):
        return encode_kv(kv, self.disk.quant, torch.device("cpu"))

    def _index(self, record: ChunkRecord) -> None:
        self.records[record.key] = record
        # Python's hash of an int tuple is deterministic; the anchor index lives in memory only.
        for offset in range(0, record.num_tokens - ANCHOR_LEN + 1, ANCHOR_LEN):
            anchor = hash(record.tokens[offset:offset + ANCHOR_LEN])
            self._anchors.setdefault(anchor, []).append((record.key, offset))
        if record.kind == "chunk":
            self._by_content.setdefault(record.content_key, set()).add(record.key)
            self._chunks_by_parent.setdefault(record.parent, set()).add(record.key)
        else:
            self._tails_by_parent.setdefault(record.parent, set()).add(record.key)

    def _make_room(self, level: int, num_bytes: int) -> bool:
        """Frees memory tier `level` for `num_bytes` by demoting its policy's first victims one tier down."""
        tier = self.memory_tiers[level]
        if tier.fits(num_bytes):
            return True
        if num_bytes > tier.budget_bytes:
            return False
        candidates = rank(self.policy, [r for r in self.records.values() if r.ref_count == 0 and r.tier == tier.name])
        for record in candidates:
            self._demote(record, level)
            if tier.fits(num_bytes):
                return True
        return False

    def _demote(self, record: ChunkRecord, level: int) -> None:
        tier = self.memory_tiers[level]
        stored = tier.remove(record.key)
        self.counters.demoted += 1
        if level + 1 < len(self.memory_tiers):
            lower = self.memory_tiers[level + 1]
            if stored.quant == lower.quant and lower.device == tier.device and not lower.pin:
                moved = stored  # same form, same memory: the payload just changes owner
            else:
                moved = lower.encode(decode_kv(stored, lower.device))
            if moved.nbytes <= lower.budget_bytes and self._make_room(level + 1, moved.nbytes):
                lower.put(record.key, moved)
                record.tier = lower.name
                record.lossy = record.lossy or lower.quant != "none"
                return
        if record.on_disk:
            record.tier = "disk"
            return
        if self.disk is not None:
            self._write_disk(record, decode_kv(stored, torch.device("cpu")), record.lossy)
            if record.on_disk:
                record.tier = "disk"
                return
        self._unindex(record.key)
        self.counters.evicted += 1

    def eviction_order(self) -> list[bytes]:
        """Device-tier keys in the order they would leave it now (entries in use excluded)."""
        evictable = [r for r in self.records.values() if r.ref_count == 0 and r.tier == "device"]
        return [r.key for r in rank(self.policy, evictable)]

    def _remove(self, key: bytes) -> None:
        """Drops the entry from memory (every tier but disk) and from the indexes."""
        record = self.records[key]
        assert record.ref_count == 0, "evicting an entry in use"
        for tier in self.memory_tiers:
            if key in tier:
                tier.remove(key)
        self._unindex(key)

    def _unindex(self, key: bytes) -> None:
        record = self.records.pop(key)
        self._staged.pop(key, None)
        self._unpersisted.discard(key)
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
        """Forgets every entry not in use, in every tier (this model's disk entries too)."""
        keys = [k for k, r in self.records.items() if r.ref_count == 0]
        on_disk = [k for k in keys if self.records[k].on_disk]
        for key in keys:
            self._remove(key)
        if self.disk is not None:
            self.disk.remove(on_disk)

    def tier_bytes(self) -> dict[str, int]:
        """Bytes per tier from counters (no index query: a UI thread calls this every second)."""
        sizes = {t.name: t.num_bytes for t in self.memory_tiers}
        if self.disk is not None:
            sizes["disk"] = self.disk.used_bytes
        return sizes

    def tier_quants(self) -> dict[str, str]:
        """How each tier keeps KV: "none" (lossless), "int8" or "int4" (engine.kv.kv_quant)."""
        quants = {t.name: t.quant for t in self.memory_tiers}
        if self.disk is not None:
            quants["disk"] = self.disk.quant
        return quants

    def tier_budgets(self) -> dict[str, int]:
        budgets = {t.name: t.budget_bytes for t in self.memory_tiers}
        if self.disk is not None:
            budgets["disk"] = self.disk.budget_bytes
        return budgets

    def tier_budget_rules(self) -> dict[str, str]:
        """Where each memory tier's budget came from ("set by cache_bytes", "default: 10% of 23.4 GiB RAM")."""
        return {t.name: t.budget_rule for t in self.memory_tiers if t.budget_rule is not None}

    def tier_entries(self) -> dict[str, int]:
        """Entries per memory tier (a dict's length: safe from another thread)."""
        return {t.name: len(t) for t in self.memory_tiers}

    def stats(self) -> dict:
        num_chunks = sum(1 for r in self.records.values() if r.kind == "chunk")
        tiers = {}
        for tier in self.memory_tiers:
            tiers[tier.name] = {"entries": len(tier), "bytes": tier.num_bytes, "budget_bytes": tier.budget_bytes,
                                "kv_quant": tier.quant, "budget_rule": tier.budget_rule}
        if self.disk is not None:
            tiers["disk"] = {"entries": sum(1 for r in self.records.values() if r.on_disk),
                             "bytes": self.disk.num_bytes(), "budget_bytes": self.disk.budget_bytes,
                             "kv_quant": self.disk.quant, "folder": str(self.disk.folder),
                             **{k: v for k, v in vars(self.disk.counters).items()}}
        if self.remote is not None:
            tiers["remote"] = self.remote.stats()
        counters = self.counters
        return {"entries": len(self.records), "chunks": num_chunks, "tails": len(self.records) - num_chunks,
                "bytes": self.num_bytes, "budget_bytes": self.budget_bytes,
                "tokens": sum(r.num_tokens for r in self.records.values()), "hits": dict(counters.hits),
                "tier_hits": dict(counters.tier_hits), "misses": counters.misses, "stored": counters.stored,
                "evicted": counters.evicted, "demoted": counters.demoted, "promoted": counters.promoted,
                "disk_misses": counters.disk_misses, "rejected": counters.rejected, "policy": self.policy.name,
                "tiers": tiers}
