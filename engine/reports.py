"""What an engine reports about itself, as frozen dataclasses read by attribute: info() (EngineInfo: the model it
serves), memory() (MemoryReport: bytes held per tier) and cache_stats() (CacheStats: the store's counters, each
tier's in TierStats).

`to_dict()` is each report as the JSON the API and the front ends have always shown (the server, `kvboost chat`'s
/stats json, the app's model info and memory meter, the benchmarks' output): the same keys in the same order, a
key the dict held only sometimes (disk_error, remote, device_used_bytes, ...) present only when the report has it.
Field order is that key order, so keep it when adding a field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


def _omitted_when_none(default=None):
    """A field whose key to_dict() leaves out while its value is None (the dicts had no such key then)."""
    return field(default=default, metadata={"omit_none": True})


def _plain(value):
    """A field's value as JSON data: a nested report as its dict, a dict copied (its values likewise)."""
    if isinstance(value, _Report):
        return value.to_dict()
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


class _Report:
    """to_dict() of the report dataclasses below."""

    def to_dict(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)
                if not (f.metadata.get("omit_none") and getattr(self, f.name) is None)}


@dataclass(frozen=True, kw_only=True)
class MemoryTierStats(_Report):
    """The device tier or host RAM in cache_stats() (engine.kv.tiers.MemoryTier)."""

    entries: int
    bytes: int
    budget_bytes: int
    kv_quant: str  # "none", "int8" or "int4"
    budget_rule: str | None = _omitted_when_none()  # where the budget came from: "set by cache_bytes", "default: ..."


@dataclass(frozen=True, kw_only=True)
class DiskTierStats(_Report):
    """The disk tier in cache_stats(): what this process's records hold on disk, the folder's bytes and budget,
    and this process's disk counters (engine.kv.disk.DiskCounters)."""

    entries: int
    bytes: int
    budget_bytes: int
    kv_quant: str
    folder: str
    writes: int
    reads: int
    read_bytes: int
    read_ms: float
    bad: int  # missing / truncated / corrupt files found on read (served as MISS)
    errors: int  # index or folder failures: the operation did nothing
    evicted: int
    rejected: int


@dataclass(frozen=True, kw_only=True)
class RemoteTierStats(_Report):
    """The shared tier (engine.kv.remote_tier.RemoteTier.stats): where it is (the URL without its password), its
    breaker, its write queue, the prefill rate its reads are timed by, and its counters (RemoteCounters)."""

    url: str
    namespace: str
    kv_quant: str
    state: str  # the breaker: "closed", "open" or "half-open"
    breaker_trips: int
    last_error: str | None
    queued: int
    prefill_tokens_per_s: float | None  # None until this engine has measured a prefill
    max_value_bytes: int
    lookups: int
    hits: int
    misses: int
    bad: int
    unread: int
    read_bytes: int
    read_ms: float
    writes: int
    written_bytes: int
    dropped: int
    skipped: int
    refused: int
    errors: int


@dataclass(frozen=True, kw_only=True)
class TierStats(_Report):
    """Each tier the store has, fastest first; None where the engine runs without it."""

    device: MemoryTierStats
    host: MemoryTierStats | None = _omitted_when_none()
    disk: DiskTierStats | None = _omitted_when_none()
    remote: RemoteTierStats | None = _omitted_when_none()

    @classmethod
    def from_store(cls, tiers: dict) -> "TierStats":
        """From ChunkStore.stats()["tiers"] (a key per tier the store has)."""
        def part(name, kind):
            return kind(**tiers[name]) if name in tiers else None

        return cls(device=MemoryTierStats(**tiers["device"]), host=part("host", MemoryTierStats),
                   disk=part("disk", DiskTierStats), remote=part("remote", RemoteTierStats))


@dataclass(frozen=True, kw_only=True)
class ChunkingStats(_Report):
    mode: str
    size: int


@dataclass(frozen=True, kw_only=True)
class CacheStats(_Report):
    """cache_stats(): the store's entries and counters since the engine was made (engine.kv.store.ChunkStore.stats),
    each tier's in `tiers`, with the engine's reuse mode, why its disk tier is off (if it is) and its chunking."""

    entries: int
    chunks: int
    tails: int
    bytes: int  # in the memory tiers
    budget_bytes: int  # the device tier's
    tokens: int
    hits: dict[str, int]  # by kind: "EXACT", "PREFIX", "APPROXIMATE", "QUANTIZED"
    tier_hits: dict[str, int]  # by the tier the reused KV came from: "device", "host", "disk", "remote"
    misses: int
    stored: int
    evicted: int
    demoted: int
    promoted: int
    disk_misses: int
    rejected: int
    policy: str  # the eviction policy
    tiers: TierStats
    reuse: str
    disk_error: str | None = _omitted_when_none()
    chunking: ChunkingStats


@dataclass(frozen=True, kw_only=True)
class MemoryReport(_Report):
    """memory(): bytes held by the weights and by cached KV per tier (keyed "device", "host", "disk": the tiers
    the store has), the shared tier's state and counters when there is one, and on a CUDA device its totals."""

    device: str
    weights_bytes: int  # on the device: packed int4 codes, scales and offsets included
    streamed_weights_bytes: int  # layer streaming: the weights kept off the device (0 without it)
    kv_bytes: dict[str, int]
    kv_budget_bytes: dict[str, int]
    kv_quant: dict[str, str]
    kv_entries: dict[str, int] = field(default_factory=dict)  # the memory tiers' (the disk's would need a query)
    kv_budget_rules: dict[str, str] = field(default_factory=dict)  # the memory tiers': MemoryTierStats.budget_rule
    disk_error: str | None = _omitted_when_none()
    remote: RemoteTierStats | None = _omitted_when_none()
    device_used_bytes: int | None = _omitted_when_none()  # CUDA only, as the others below
    device_total_bytes: int | None = _omitted_when_none()


@dataclass(frozen=True, kw_only=True)
class GgufTensors(_Report):
    """The tensors of one GGUF type held in one form (engine.weights.gguf_loader counts them as it loads)."""

    tensors: int
    file_bytes: int  # as the file holds them
    bytes: int  # as they are held


@dataclass(frozen=True, kw_only=True)
class WeightsChoice(_Report):
    """What a load was asked for and what it loaded (engine.weights.loader.load_model): "auto" becomes a format for
    a reason a front end shows."""

    asked: str  # engine.config.WEIGHT_FORMATS
    loaded: str
    why: str


@dataclass(frozen=True, kw_only=True)
class WeightStreaming(_Report):
    """Layer streaming as it runs under an engine (engine.weights.stream_setup.Streaming): which decoder layers stay
    on the device and which are copied into a slot before they run, the bytes of each, the plan's budget and the
    decode speed the measured copy bandwidth allows."""

    resident_layers: list[int]
    streamed_layers: list[int]
    resident_bytes: int  # on the device: everything outside the streamed layers' images, the slots included
    streamed_bytes: int
    min_budget_bytes: int
    budget_bytes: int
    num_slots: int
    slot_bytes: int
    bandwidth_bytes_per_s: float
    predicted_decode_tokens_per_s: float | None  # None when nothing streams


@dataclass(frozen=True, kw_only=True)
class WeightsReport(_Report):
    """What a load holds (engine.weights.weights_report): the decoder linears' format and kernel, the head's and the
    table's, the bytes held, a GGUF's mix of what each tensor type became, what weights="auto" chose, the attention
    implementation, and layer streaming where the engine streams (its `resident_bytes` is then what stays on the
    device)."""

    # "float32", "bfloat16", ..., "int4-g128" (quantized at load), "awq-int4-g128", "gguf-q4_1-g32" (a GGUF's 4-bit
    # codes as int4 groups), "gguf-q4_k" (a GGUF type's blocks as the file holds them), "int8" (int8 rows); several
    # joined by "+", most common first
    format: str
    kernel: str  # the linears' matmul path: "dense", "reference", "cpu_int4pack", "tinygemm", "gguf_blocks", "+"-joined
    fallback_reason: str | None  # why a faster int4 path is not used
    head: str  # the output head's format: "float32", "int8", "int4-g32", ...
    head_kernel: str  # "dense", "cpu_int8pack", "reference", ...
    embedding: str  # the input table's format, as `head`
    resident_bytes: int  # every parameter and buffer held, packed weights, scales and zeros included
    linear_bytes: int  # the decoder layers' linears as held
    linear_float32_bytes: int  # the same linears in float32
    head_bytes: int  # the head as held; 0 when it shares its float weight with the table
    num_int4_linears: int
    gguf: dict[str, GgufTensors] | None  # by "<GGUF type>-><form>" ("Q4_K->int4", "Q6_K->blocks"); None: no GGUF
    choice: WeightsChoice | None  # None for a model built outside engine.weights.loader
    attention: str | None  # "sdpa", "rows_exact", "sdpa_float64" (engine.exact_attention)
    streaming: WeightStreaming | None = _omitted_when_none()


@dataclass(frozen=True, kw_only=True)
class EngineInfo(_Report):
    """info(): what a front end shows about the loaded model, its weights in `weights`."""

    name: str
    model_type: str
    max_context: int
    device: str
    dtype: str
    reuse: str
    cache_folder: str | None  # the disk tier's folder; None when it is off
    disk_error: str | None  # why the disk tier is off when it could not be opened
    weights: WeightsReport
    cuda_graphs_unavailable: str | None
    layer_streaming_unavailable: str | None

    def to_dict(self) -> dict:
        # "awq_unavailable": layer_streaming_unavailable's old name, which clients of the API read (for one release)
        return super().to_dict() | {"awq_unavailable": self.layer_streaming_unavailable}
