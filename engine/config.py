"""Engine options as frozen dataclasses. `validate()` raises ValueError naming the bad value.

Each field carries one line of help (`option(default, help)`, read back by `help_of`): the options reference
of the documentation is generated from these fields (docs/hooks/options.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

REUSE_MODES = ("off", "prefix", "chunk", "approx")
CHUNKING_MODES = ("fixed", "semantic", "adaptive")
REPAIR_MODES = ("none", "selective", "cacheblend")
KV_QUANT_MODES = ("none", "int8", "int4")
EVICTION_POLICIES = ("lru", "importance-lru")
REMOTE_SCHEMES = ("redis", "rediss", "unix")


def option(default=dataclasses.MISSING, help: str = "", *, factory=dataclasses.MISSING):
    """A dataclass field with its default (or default factory) and one line of help."""
    if not help:
        raise ValueError("an option needs its help text")
    return field(default=default, default_factory=factory, metadata={"help": help})


def help_of(config_class, name: str) -> str:
    """The help text of option `name` of `config_class` ("" for a field declared without one)."""
    return next(f.metadata.get("help", "") for f in dataclasses.fields(config_class) if f.name == name)


@dataclass(frozen=True)
class ChunkingConfig:
    """How prompt token ids are cut into chunks.

    fixed: every `size` tokens. semantic: at paragraph/sentence ends, chunks between `size // 4` and `size`
    tokens. adaptive: each fixed cut moves within +-`window` tokens to the nearest sentence/line boundary.
    """

    mode: str = option("fixed", f"how chunks are cut: one of {CHUNKING_MODES}")
    size: int = option(128, "tokens a chunk (fixed, adaptive) or at most (semantic); >= 8")
    window: int = option(16, "adaptive: how far (tokens) a cut may move to a sentence or line break")

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

    mode: str = option("selective", f"seam repair of APPROXIMATE hits: one of {REPAIR_MODES} (chosen by measurement)")
    selective_tokens: int = option(16, "selective: tokens recomputed after each seam")
    selective_before: int = option(0, "selective: reused tokens recomputed just before each seam")
    blend_ratio: float = option(0.15, "cacheblend: share of reused tokens recomputed past the probe layer")
    probe_layer: int = option(1, "cacheblend: the layer whose value deviation picks those tokens")
    blend_seam_tokens: int = option(0, "cacheblend: also always recompute this many tokens after each seam")

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
    as QUANTIZED, never EXACT (docs/engine.md, bench/kv_tiers.py)."""

    device: str = option("none", f"KV kept on the device tier: one of {KV_QUANT_MODES}")
    host: str = option("none", f"KV kept in host RAM: one of {KV_QUANT_MODES}")
    disk: str = option("none", f"KV kept on disk: one of {KV_QUANT_MODES}")

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
    """What an engine does with the model it serves: reuse, KV tiers, decoding (`KVBoost(model, tokenizer,
    config)`; from_pretrained's keywords fill it)."""

    reuse: str = option("chunk", f"which KV is reused: one of {REUSE_MODES} ('approx' moves documents' KV)")
    chunking: ChunkingConfig = option(factory=ChunkingConfig, help="how prompts are cut into chunks (below)")
    repair: RepairConfig = option(factory=RepairConfig, help="seam repair for reuse='approx' (below)")
    cache_bytes: int | None = option(None, "the device tier's KV budget (the GPU, or RAM on a CPU-only machine); "
                                           "None: sized from the machine")
    cpu_cache_bytes: int | None = option(None, "the host RAM tier's budget; None: sized from the machine, 0: off")
    disk_cache_bytes: int | None = option(None, "the disk tier's budget; None: sized from the disk, 0: off")
    disk_cache_dir: str | None = option(None, "the disk tier's folder; None: engine.disk.default_cache_dir()")
    disk_busy_timeout_s: float = option(30.0, "how long a disk index write waits for another process's lock")
    kv_quant: KVQuantConfig = option(factory=KVQuantConfig, help="KV quantization per tier (below); lossless "
                                                                 "by default")
    eviction: str = option("importance-lru", f"eviction policy: one of {EVICTION_POLICIES} (importance-lru "
                                             "measured +12% hit rate over LRU: bench/kv_tiers.py)")
    live_kv_bytes: int | None = option(None, "device bytes for the live KV of the request being generated; "
                                             "beyond it cold pages spill to host RAM (engine.paged); None: no limit")
    live_page_tokens: int = option(128, "tokens per spilled page")
    # On by default: `python -m bench speculative` measured 1.9-2.0x on quoting answers, 1.2-1.4x on needle
    # questions and 0.96-0.99x on free chat, the same greedy text everywhere (float and int4 weights).
    speculative: str | None = option("prompt-lookup", "drafts checked in the forward that feeds each token: "
                                                      "'prompt-lookup' (from the context), 'draft-model', or None")
    num_draft: int = option(4, "tokens drafted at most per forward")
    # The shared KV tier (engine.remote_tier). A read may take as long as the prefill it saves (the engine's
    # measured prefill rate times the tokens it restores), at least remote_timeout_s, at most remote_max_wait_s.
    remote_cache: str | None = option(None, "the shared KV tier: a redis://, rediss:// or unix:// URL of a Redis "
                                            "or Valkey store; None: off")
    remote_timeout_s: float = option(0.25, "a shared store silent this long while an answer is awaited is failing")
    remote_max_wait_s: float = option(10.0, "the longest a read of the shared tier may take")
    remote_retry_s: float = option(5.0, "after a failure the shared store is left alone this long")
    remote_max_value_bytes: int | None = option(None, "shared-tier values longer than this are refused unread; "
                                                      "None: the most one chunk's KV and header can take")
    # So a request joining a batch stalls the others' decode steps for one piece at a time (engine.batching).
    prefill_piece_tokens: int | None = option(256, "computed prompt runs are forwarded in pieces ending at "
                                                   "multiples of this; the same pieces alone or batched; None: one "
                                                   "pass")
    cuda_graphs: bool = option(True, "on a CUDA device, one-token decode steps replay a captured CUDA graph "
                                     "(engine.graph_decode) where the model allows it")

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
    """How one answer is sampled (the keywords of generate / chat / stream)."""

    max_new_tokens: int = option(128, "the answer's length at most, in tokens")
    temperature: float = option(0.0, "0 (or below 1e-30): greedy; above: sampling at this temperature")
    top_p: float = option(1.0, "nucleus sampling: the smallest set of tokens holding this probability")
    top_k: int = option(0, "sample among the k likeliest tokens only; 0: all")
    repetition_penalty: float = option(1.0, "divides the logits of tokens already in the prompt or answer")
    stop: tuple[str, ...] = option((), "strings that end the answer (not included in it)")
    seed: int | None = option(None, "the sampling seed; None: a fresh one each request")

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
