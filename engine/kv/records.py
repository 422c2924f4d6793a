"""What the chunk store (engine.kv.store) keeps about each entry, what it counts, and the two measures of a
payload it records: its bytes and its energy (the importance-weighted eviction policy's input)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .tiers import KV


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
    tier: str = "device"  # the fastest tier holding the payload
    on_disk: bool = False  # a copy is in the disk tier (as well, or only: tier == "disk")
    # The values of the memory copy (device/host) and of the disk copy are not the computed ones: quantized
    # (a tier's kv_quant) or computed over quantized KV. Hits on a lossy copy are QUANTIZED, never EXACT.
    lossy: bool = False
    disk_lossy: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


@dataclass
class StoreCounters:
    hits: dict[str, int] = field(default_factory=lambda: {"EXACT": 0, "PREFIX": 0, "APPROXIMATE": 0,
                                                          "QUANTIZED": 0})
    misses: int = 0
    stored: int = 0
    evicted: int = 0
    rejected: int = 0  # entries no tier could take
    tier_hits: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "disk": 0, "remote": 0})
    demoted: int = 0
    promoted: int = 0
    disk_misses: int = 0  # entries whose disk payload turned out missing/corrupt (served as MISS, recomputed)


def kv_nbytes(kv: KV) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)


def kv_importance(kv: KV) -> float:
    """Mean L2 norm of the key and value vectors over layers, heads and tokens (a cheap energy measure)."""
    norms = [t.float().norm(dim=-1).mean() for k, v in kv for t in (k, v)]
    return float(torch.stack(norms).mean()) if norms else 0.0
