"""Engine options as frozen dataclasses. `validate()` raises ValueError naming the bad value."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

REUSE_MODES = ("off", "prefix", "chunk", "approx")
CHUNKING_MODES = ("fixed", "semantic", "adaptive")
REPAIR_MODES = ("none", "selective", "cacheblend")
KV_QUANT_MODES = ("none", "int8", "int4")
EVICTION_POLICIES = ("lru", "importance-lru")
REMOTE_SCHEMES = ("redis", "rediss", "unix")


@dataclass(frozen=True)
class ChunkingConfig:
    """How prompt token ids are cut into chunks.

    fixed: every `size` tokens. semantic: at paragraph/sentence ends, chunks between `size // 4` and `size`
    tokens. adaptive: each fixed cut moves within +-`window` tokens to the nearest sentence/line boundary.
    """

    mode: str = "fixed"
    size: int = 128
    window: int = 16

    def validate(self) -> None:
        if self.mode not in CHUNKING_MODES:
            raise ValueError(f"chunking must be one of {CHUNKING_MODES}, got {self.mode!r}")
        if not isinstance(self.size, int) or self.size < 8:
            raise ValueError(f"chunk_size must be an integer >= 8, got {self.size!r}")
        if self.mode == "adaptive" and (not isinstance(self.window, int) or not 0 <= self.window < self.size // 2):
            raise ValueError(f"adaptive window must be in [0, chunk_size/2), got {self.window!r}")


@dataclass(frozen=True)
class RepairConfig:
    """Seam repair for APPROXIMATE hits (engine.approx)."""

    mode: str = "selective"  # "none" | "selective" | "cacheblend" (default chosen by measurement: README)
    selective_tokens: int = 16  # selective: tokens recomputed after each seam
    selective_before: int = 0  # selective: reused tokens recomputed just before each seam
    blend_ratio: float = 0.15  # cacheblend: share of reused tokens recomputed past the probe layer
    probe_layer: int = 1  # cacheblend: layer whose value deviation picks those tokens
    blend_seam_tokens: int = 0  # cacheblend: also always recompute this many tokens after each seam

    def validate(self) -> None:
        if self.mode not in REPAIR_MODES:
            raise ValueError(f"repair must be one of {REPAIR_MODES}, got {self.mode!r}")
        if isinstance(self.selective_tokens, bool) or not isinstance(self.selective_tokens, int) \
                or self.selective_tokens < 0:
            raise ValueError(f"selective_tokens must be an integer >= 0, got {self.selective_tokens!r}")
        if isinstance(self.selective_before, bool) or not isinstance(self.selective_before, int) \
                or self.selective_before < 0:
            raise ValueError(f"selective_before must be an integer >= 0, got {self.selective_before!r}")
        if not isinstance(self.blend_ratio, (int, float)) or not 0.0 <= self.blend_ratio <= 1.0:
            raise ValueError(f"blend_ratio must be in [0, 1], got {self.blend_ratio!r}")
        if isinstance(self.blend_seam_tokens, bool) or not isinstance(self.blend_seam_tokens, int) \
                or self.blend_seam_tokens < 0:
            raise ValueError(f"blend_seam_tokens must be an integer >= 0, got {self.blend_seam_tokens!r}")
        if isinstance(self.probe_layer, bool) or not isinstance(self.probe_layer, int) or self.probe_layer < 0:
            raise ValueError(f"probe_layer must be an integer >= 0, got {self.probe_layer!r}")


@dataclass(frozen=True)
class KVQuantConfig:
    """How each tier stores KV: "none" (as computed), "int8" or "int4" (KIVI, engine.kv_quant).

    Every tier is lossless by default: reuse never changes an answer. int8/int4 are an explicit opt-in that
    trades exactness for memory (int8 1.9x, int4 3.6x smaller than float16); hits on quantized KV are reported
    as QUANTIZED, never EXACT (README, bench/kv_tiers.py)."""

    device: str = "none"
    host: str = "none"
    disk: str = "none"

    @classmethod
    def parse(cls, value) -> "KVQuantConfig":
        """A KVQuantConfig, a dict {tier: mode}, or one mode string for the host and disk tiers."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls(host=value, disk=value)
        if isinstance(value, dict):
            unknown = set(value) - {"device", "host", "disk"}
            if unknown:
                raise ValueError(f"kv_quant tiers are 'device', 'host', 'disk', got {sorted(unknown)}")
            return cls(**value)
        raise ValueError(f"kv_quant must be one of {KV_QUANT_MODES} or a dict per tier, got {value!r}")

    def validate(self) -> None:
        for tier in ("device", "host", "disk"):
            mode = getattr(self, tier)
            if mode not in KV_QUANT_MODES:
                raise ValueError(f"kv_quant for the {tier} tier must be one of {KV_QUANT_MODES}, got {mode!r}")


def _check_bytes(name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{name} must be a non-negative integer or None, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    reuse: str = "chunk"
    chunking: ChunkingConfig = field(default_factory=ChunkingConfig)
    repair: RepairConfig = field(default_factory=RepairConfig)
    # Byte budgets per KV tier; None sizes a tier from the machine (engine.tiers, engine.disk), 0 turns the
    # host or disk tier off. cache_bytes is the device tier (the GPU, or RAM on a CPU-only machine).
    cache_bytes: int | None = None
    cpu_cache_bytes: int | None = None
    disk_cache_bytes: int | None = None
    disk_cache_dir: str | None = None  # None: engine.disk.default_cache_dir()
    disk_busy_timeout_s: float = 30.0  # how long a disk index write waits for another process's lock
    kv_quant: KVQuantConfig = field(default_factory=KVQuantConfig)
    eviction: str = "importance-lru"  # chosen by bench/kv_tiers.py (README: +12% hit rate over LRU)
    # Live KV of the request being generated kept on the device; beyond it, cold pages spill to host RAM
    # (engine.paged). None: no limit.
    live_kv_bytes: int | None = None
    live_page_tokens: int = 128  # tokens per spilled page
    # Speculative decoding (engine.speculative): "prompt-lookup" drafts up to num_draft tokens from the context
    # and checks them in the forward that feeds each token; None decodes one token per forward. On by default:
    # `python -m bench speculative` measured 1.9-2.0x on quoting answers, 1.2-1.4x on needle questions, and
    # 0.96-0.99x on free chat, the same greedy text everywhere (float and int4 weights).
    speculative: str | None = "prompt-lookup"
    num_draft: int = 4
    # The shared KV tier (engine.remote_tier): a redis://, rediss:// or unix:// URL of a Redis or Valkey store,
    # None: off. A read may take as long as the prefill it saves (the engine's measured prefill rate times the
    # tokens it restores), at least remote_timeout_s and at most remote_max_wait_s; a store silent for
    # remote_timeout_s while an answer is awaited is failing, and after a failure it is left alone for
    # remote_retry_s. Values longer than remote_max_value_bytes are refused unread (None: the most one chunk's KV
    # and its header can take, from the model).
    remote_cache: str | None = None
    remote_timeout_s: float = 0.25
    remote_max_wait_s: float = 10.0
    remote_retry_s: float = 5.0
    remote_max_value_bytes: int | None = None
    # Computed prompt runs are forwarded in pieces ending at multiples of this many tokens (engine.prefill), so a
    # request joining a batch stalls the others' decode steps for one piece at a time (engine.batching); the
    # same pieces alone or batched. None: each run in one pass.
    prefill_piece_tokens: int | None = 256
    # On a CUDA device, one-token decode steps replay a captured CUDA graph (engine.graph_decode) where the model
    # allows it; False: every step through transformers' forward.
    cuda_graphs: bool = True

    def validate(self) -> None:
        if self.reuse not in REUSE_MODES:
            raise ValueError(f"reuse must be one of {REUSE_MODES}, got {self.reuse!r}")
        self.repair.validate()
        for name in ("cache_bytes", "cpu_cache_bytes", "disk_cache_bytes", "live_kv_bytes"):
            _check_bytes(name, getattr(self, name))
        if self.live_kv_bytes == 0:
            raise ValueError("live_kv_bytes must be positive (None: no limit)")
        if isinstance(self.live_page_tokens, bool) or not isinstance(self.live_page_tokens, int) \
                or self.live_page_tokens < 1:
            raise ValueError(f"live_page_tokens must be a positive integer, got {self.live_page_tokens!r}")
        if isinstance(self.disk_busy_timeout_s, bool) or not isinstance(self.disk_busy_timeout_s, (int, float)) \
                or not self.disk_busy_timeout_s > 0:
            raise ValueError(f"disk_busy_timeout_s must be a positive number, got {self.disk_busy_timeout_s!r}")
        if self.disk_cache_dir is not None and not isinstance(self.disk_cache_dir, str):
            raise ValueError(f"disk_cache_dir must be a path string or None, got {self.disk_cache_dir!r}")
        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {EVICTION_POLICIES}, got {self.eviction!r}")
        self.kv_quant.validate()
        self.chunking.validate()
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be True or False, got {self.cuda_graphs!r}")
        if self.speculative not in (None, "prompt-lookup", "draft-model"):
            raise ValueError(f"speculative must be 'prompt-lookup', 'draft-model' or None, got {self.speculative!r}")
        if isinstance(self.num_draft, bool) or not isinstance(self.num_draft, int) or not 1 <= self.num_draft <= 32:
            raise ValueError(f"num_draft must be an integer in 1..32, got {self.num_draft!r}")
        if self.remote_cache is not None and (not isinstance(self.remote_cache, str) or
                                              self.remote_cache.split("://", 1)[0] not in REMOTE_SCHEMES):
            shown = self.remote_cache.rsplit("@", 1)[-1] if isinstance(self.remote_cache, str) else self.remote_cache
            raise ValueError(f"remote_cache must be a redis://, rediss:// or unix:// URL or None, got {shown!r}")
        for name in ("remote_timeout_s", "remote_max_wait_s", "remote_retry_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if self.remote_max_wait_s < self.remote_timeout_s:
            raise ValueError(f"remote_max_wait_s ({self.remote_max_wait_s!r}) must be at least remote_timeout_s "
                             f"({self.remote_timeout_s!r})")
        value = self.remote_max_value_bytes
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"remote_max_value_bytes must be a positive integer or None, got {value!r}")
        piece = self.prefill_piece_tokens
        if piece is not None and (isinstance(piece, bool) or not isinstance(piece, int) or piece < 1):
            raise ValueError(f"prefill_piece_tokens must be a positive integer or None, got {piece!r}")


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None

    @classmethod
    def from_kwargs(cls, *, stop=None, **kwargs) -> "SamplingConfig":
        if stop is None:
            stops: tuple[str, ...] = ()
        elif isinstance(stop, str):
            stops = (stop,)
        else:
            stops = tuple(stop)
        cfg = cls(stop=stops, **kwargs)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        def number(name, value):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")

        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
