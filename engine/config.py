"""Engine options as frozen dataclasses. `validate()` raises ValueError naming the bad value.

Each option exists once, here: a field with its default, its allowed values and one line of help
(`option(default, help, choices=...)`). Everything else is read from the fields: from_pretrained's and
with_options' keywords (`split_options`: one flat name per option, e.g. "chunk_size" for ChunkingConfig.size),
the command lines' flags (engine.cli.add_engine_options, one loop), the app's settings (app.settings) and the
options reference of the documentation (docs/hooks/options.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

REUSE_MODES = ("off", "prefix", "chunk", "approx")
CHUNKING_MODES = ("fixed", "semantic", "adaptive")
REPAIR_MODES = ("none", "selective", "cacheblend")
KV_QUANT_MODES = ("none", "int8", "int4")
EVICTION_POLICIES = ("lru", "importance-lru")
REMOTE_SCHEMES = ("redis", "rediss", "unix")
# What a load may be asked for (LoadOptions); the loaders check against the same tuples.
DEVICE_KINDS = ("auto", "cpu", "cuda", "mps")  # "cuda:N" too
DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = ("fp32", "bf16", "fp16")
WEIGHT_FORMATS = ("float", "int4", "auto")
GROUP_SIZES = (32, 64, 128)
HEAD_FORMATS = ("float", "int8", "int8+embedding", "int4", "int4+embedding")
HEAD_CHOICES = ("auto", *HEAD_FORMATS)  # "auto": engine.head.auto_head
INT4_KERNELS = ("reference", "cpu_int4pack", "tinygemm")
BLOCK_KERNEL = "gguf_blocks"  # engine.gguf_blocks
KERNEL_CHOICES = ("auto", BLOCK_KERNEL, *INT4_KERNELS)
STREAM_SLOTS = 2  # layer streaming's default copy slots
SPECULATIVE_MODES = ("prompt-lookup", "draft-model", None)


def option(default=dataclasses.MISSING, help: str = "", *, factory=dataclasses.MISSING, choices=None,
           name: str | None = None, flags: tuple[str, ...] = ()):
    """A dataclass field with its default (or default factory), one line of help, and where it has them its
    allowed values (`choices`), its flat name where that is not the field's own (`name`: ChunkingConfig.size is
    "chunk_size") and older command-line spellings kept working (`flags`)."""
    if not help:
        raise ValueError("an option needs its help text")
    return field(default=default, default_factory=factory,
                 metadata={"help": help, "choices": choices, "name": name, "flags": tuple(flags)})


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")


def help_of(config_class, name: str) -> str:
    """The help text of option `name` of `config_class` ("" for a field declared without one)."""
    return next(f.metadata.get("help", "") for f in dataclasses.fields(config_class) if f.name == name)


@dataclass(frozen=True)
class ChunkingConfig:
    """How prompt token ids are cut into chunks.

    fixed: every `size` tokens. semantic: at paragraph/sentence ends, chunks between `size // 4` and `size`
    tokens. adaptive: each fixed cut moves within +-`window` tokens to the nearest sentence/line boundary.
    """

    mode: str = option("fixed", "how chunks are cut", choices=CHUNKING_MODES, name="chunking")
    size: int = option(128, "tokens a chunk (fixed, adaptive) or at most (semantic); >= 8", name="chunk_size")
    window: int = option(16, "adaptive: how far (tokens) a cut may move to a sentence or line break",
                         name="chunk_window")

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

    mode: str = option("selective", "seam repair of APPROXIMATE hits (chosen by measurement)", choices=REPAIR_MODES,
                       name="repair")
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

    reuse: str = option("chunk", "which KV is reused ('approx' moves documents' KV and may change answers: "
                                 "docs/engine.md)", choices=REUSE_MODES)
    chunking: ChunkingConfig = option(factory=ChunkingConfig, help="how prompts are cut into chunks (below)")
    repair: RepairConfig = option(factory=RepairConfig, help="seam repair for reuse='approx' (below)")
    cache_bytes: int | None = option(None, "the device tier's KV budget (the GPU, or RAM on a CPU-only machine); "
                                           "None: sized from the machine", flags=("--gpu-cache-bytes",))
    cpu_cache_bytes: int | None = option(None, "the host RAM tier's budget; None: sized from the machine, 0: off")
    disk_cache_bytes: int | None = option(None, "the disk tier's budget; None: sized from the disk, 0: off")
    disk_cache_dir: str | None = option(None, "the disk tier's folder; None: engine.disk.default_cache_dir()")
    disk_busy_timeout_s: float = option(30.0, "how long a disk index write waits for another process's lock")
    kv_quant: KVQuantConfig = option(factory=KVQuantConfig, help="KV quantization per tier (below), or one mode "
                                     "for host RAM and disk; lossless by default (int8/int4 hits are reported as "
                                     "QUANTIZED)", choices=KV_QUANT_MODES)
    eviction: str = option("importance-lru", "eviction policy (importance-lru measured +12% hit rate over LRU: "
                                             "bench/kv_tiers.py)", choices=EVICTION_POLICIES)
    live_kv_bytes: int | None = option(None, "device bytes for the live KV of the request being generated; "
                                             "beyond it cold pages spill to host RAM (engine.paged); None: no limit")
    live_page_tokens: int = option(128, "tokens per spilled page")
    # On by default: `python -m bench speculative` measured 1.9-2.0x on quoting answers, 1.2-1.4x on needle
    # questions and 0.96-0.99x on free chat, the same greedy text everywhere (float and int4 weights).
    speculative: str | None = option("prompt-lookup", "drafts checked in the forward that feeds each token: "
                                                      "'prompt-lookup' (from the context), 'draft-model' (from "
                                                      "the load's draft model), or None (off)",
                                   choices=SPECULATIVE_MODES)
    num_draft: int = option(4, "tokens drafted at most per forward")
    # The shared KV tier (engine.remote_tier). A read may take as long as the prefill it saves (the engine's
    # measured prefill rate times the tokens it restores), at least remote_timeout_s, at most remote_max_wait_s.
    remote_cache: str | None = option(None, "the shared KV tier: a redis://, rediss:// or unix:// URL of a Redis "
                                            "or Valkey store; None: off")
    remote_timeout_s: float = option(0.25, "a shared store silent this long while an answer is awaited is "
                                           "failing; also the least a read may take", flags=("--remote-timeout",))
    remote_max_wait_s: float = option(10.0, "the longest a read of the shared tier may take, however much "
                                            "prefill it saves", flags=("--remote-max-wait",))
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
        _check_choice("reuse", self.reuse, REUSE_MODES)
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
        _check_choice("speculative", self.speculative, SPECULATIVE_MODES)
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


@dataclass(frozen=True)
class LoadOptions:
    """How a model is loaded: where, in which number format, with which kernels (`from_pretrained(source,
    load=LoadOptions(...))`; its keywords fill it). An engine made by with_options keeps the model as loaded."""

    device: str = option("auto", "cpu, cuda, cuda:N or auto (a GPU where there is one)")
    dtype: str = option("auto", "compute dtype; auto: bfloat16 on a GPU that has it, float32 on a CPU",
                        choices=DTYPES)
    weights: str = option("auto", "auto: as the file is (a GGUF's 4-bit blocks and AWQ/GPTQ as 4-bit; float "
                                  "models as float where they fit); float: dequantized; int4: quantized at load",
                          choices=WEIGHT_FORMATS)
    group_size: int = option(128, "int4 group size when float weights are quantized at load (RTN)",
                             choices=GROUP_SIZES)
    head: str = option("auto", "the output head (and with +embedding the input table) in fewer bytes; auto: as "
                               "the file keeps it, or int8 under int4 layers where the int8 kernel runs",
                       choices=HEAD_CHOICES)
    kernel: str = option("auto", "the matmul of 4-bit layers: the GGUF block kernel or an int4 one",
                         choices=KERNEL_CHOICES)
    layer_streaming: bool = option(False, "4-bit decoder layers that do not fit the weight budget live off the "
                                          "device and are copied in one at a time before they run")
    weight_budget_bytes: int | None = option(None, "layer streaming: device bytes for the weights; None: 90% of "
                                                   "free VRAM (CUDA) or of available RAM (CPU)")
    stream_slots: int = option(STREAM_SLOTS, "layer streaming: device slots streamed layers are copied into")
    draft_model: str | None = option(None, "a smaller model of the same tokenizer that drafts tokens (a source "
                                           "like the model's; implies speculative='draft-model')")

    def validate(self) -> None:
        if not isinstance(self.device, str) or self.device.split(":", 1)[0] not in DEVICE_KINDS or (
                ":" in self.device and not self.device.split(":", 1)[1].isdigit()):
            raise ValueError(f"device must be auto, cpu, cuda, cuda:N or mps, got {self.device!r}")
        if type(self.dtype).__module__ != "torch":  # a torch.dtype is taken as it is
            _check_choice("dtype", self.dtype, DTYPES + DTYPE_ALIASES)
        _check_choice("weights", self.weights, WEIGHT_FORMATS)
        _check_choice("group_size", self.group_size, GROUP_SIZES)
        _check_choice("head", self.head, HEAD_CHOICES)
        _check_choice("kernel", self.kernel, KERNEL_CHOICES)
        if not isinstance(self.layer_streaming, bool):
            raise ValueError(f"layer_streaming must be True or False, got {self.layer_streaming!r}")
        _check_bytes("weight_budget_bytes", self.weight_budget_bytes)
        if isinstance(self.stream_slots, bool) or not isinstance(self.stream_slots, int) or self.stream_slots < 1:
            raise ValueError(f"stream_slots must be a positive integer, got {self.stream_slots!r}")
        if self.draft_model is not None and not isinstance(self.draft_model, str):
            raise ValueError(f"draft_model must be a source string or None, got {self.draft_model!r}")


@dataclass(frozen=True)
class Option:
    """One option under its flat name: the dataclass (`owner`) and field path it fills, its field."""

    name: str
    owner: type  # LoadOptions or EngineConfig
    path: tuple[str, ...]  # field names from the owner down, e.g. ("chunking", "size")
    field: dataclasses.Field

    @property
    def default(self):
        if self.field.default is not dataclasses.MISSING:
            return self.field.default
        return None if self.choices else self.field.default_factory()

    @property
    def choices(self):
        return self.field.metadata.get("choices")

    @property
    def help(self) -> str:
        return self.field.metadata.get("help", "")

    @property
    def flags(self) -> tuple[str, ...]:
        return self.field.metadata.get("flags", ())

    @property
    def aliases(self) -> tuple[str, ...]:
        """Older keywords of the option: its older flags' names ("--gpu-cache-bytes": "gpu_cache_bytes")."""
        return tuple(flag.lstrip("-").replace("-", "_") for flag in self.flags)


def _flatten(owner: type, config_class: type, path: tuple[str, ...]) -> list[Option]:
    out = []
    for f in dataclasses.fields(config_class):
        nested = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(nested) and not f.metadata.get("choices"):
            out += _flatten(owner, nested, path + (f.name,))  # chunking, repair: their fields by their own names
        else:
            out.append(Option(f.metadata.get("name") or f.name, owner, path + (f.name,), f))
    return out


@functools.lru_cache(maxsize=1)
def options() -> dict[str, Option]:
    """Every load and engine option by its flat name: the keywords of from_pretrained and the flags of the
    command lines (`--chunk-size` for "chunk_size")."""
    table = {}
    for opt in _flatten(LoadOptions, LoadOptions, ()) + _flatten(EngineConfig, EngineConfig, ()):
        assert opt.name not in table, opt.name  # one name, one option
        table[opt.name] = opt
    return table


def _with(config, path: tuple[str, ...], value):
    if len(path) == 1:
        return dataclasses.replace(config, **{path[0]: value})
    return dataclasses.replace(config, **{path[0]: _with(getattr(config, path[0]), path[1:], value)})


def split_options(values: dict, load: LoadOptions | None = None,
                  config: EngineConfig | None = None) -> tuple[LoadOptions, EngineConfig]:
    """`load` and `config` (None: the defaults) with `values` (flat names: options(), or an option's older name)
    applied, both validated. A name that is no option is a TypeError naming it; an option given under two names
    with two values is a ValueError."""
    table = options()
    values = dict(values)
    for opt in table.values():
        for alias in opt.aliases:
            if alias in values:
                value = values.pop(alias)
                if values.get(opt.name, value) != value:
                    raise ValueError(f"{opt.name} and {alias} are the same option; pass one of them")
                values[opt.name] = value
    unknown = sorted(set(values) - set(table))
    if unknown:
        raise TypeError(f"unknown option(s) {unknown}; the options are {sorted(table)}")
    built = {LoadOptions: load or LoadOptions(), EngineConfig: config or EngineConfig()}
    for name, value in values.items():
        opt = table[name]
        if name == "kv_quant":
            value = KVQuantConfig.parse(value)
        elif name == "disk_cache_dir" and value is not None:
            value = str(value)  # a Path is taken too
        built[opt.owner] = _with(built[opt.owner], opt.path, value)
    built[LoadOptions].validate()
    built[EngineConfig].validate()
    return built[LoadOptions], built[EngineConfig]
