"""Engine options as frozen dataclasses. `validate()` raises ValueError naming the bad value.

Each option exists once, here: a field with its default, its allowed values and one line of help
(`option(default, help, choices=...)`). Everything else is read from the fields: from_pretrained's and
with_options' keywords (`split_options`: one flat name per option however deep its field, e.g. "chunk_size" for
EngineConfig.reuse.chunking.size; EngineConfig.of takes the same names), the command lines' flags
(cli.kvboost.add_engine_options, one loop), the app's settings (app.settings) and the options reference of the
documentation (docs/hooks/options.py).

Over 400 lines: every option of the project with its help, bounds and checks is the point of this module; the
flat table that the command lines, the settings and the docs read sits beside the fields it walks.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

REUSE_MODES = ("off", "prefix", "chunk", "approx")
CHUNKING_MODES = ("fixed", "semantic", "adaptive")
REPAIR_MODES = ("none", "selective", "cacheblend")
BLEND_SELECTIONS = ("deviation", "random")
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
HEAD_CHOICES = ("auto", *HEAD_FORMATS)  # "auto": engine.weights.head.auto_head
INT4_KERNELS = ("reference", "cpu_int4pack", "tinygemm")
BLOCK_KERNEL = "gguf_blocks"  # engine.weights.gguf_blocks
KERNEL_CHOICES = ("auto", BLOCK_KERNEL, *INT4_KERNELS)
STREAM_SLOTS = 2  # layer streaming's default copy slots
SPECULATIVE_MODES = ("prompt-lookup", "draft-model", None)


def option(default=dataclasses.MISSING, help: str = "", *, factory=dataclasses.MISSING, choices=None,
           name: str | None = None, flags: tuple[str, ...] = (), kind: type | None = None, low=None, above=None,
           high=None, optional: bool = False):
    """A dataclass field with its default (or default factory), one line of help, and where it has them its
    allowed values (`choices`), its flat name where that is not the field's own (`name`: ChunkingConfig.size is
    "chunk_size") and older command-line spellings kept working (`flags`). `kind` (int, float, bool, str) with
    its bounds (`low` <= value, `above` < value, value <= `high`; `optional`: None allowed too) is what
    check_fields holds the value to."""
    if not help:
        raise ValueError("an option needs its help text")
    return field(default=default, default_factory=factory,
                 metadata={"help": help, "choices": choices, "name": name, "flags": tuple(flags), "kind": kind,
                           "low": low, "above": above, "high": high, "optional": optional})


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")


def _wanted(meta: dict) -> str:
    """What a field's kind and bounds ask for, in words: "an integer >= 1", "a number in [0, 1]", ..."""
    kind, low, above, high = meta["kind"], meta["low"], meta["above"], meta["high"]
    noun = {int: "an integer", float: "a number", bool: "True or False", str: "a string"}[kind]
    if low is not None and high is not None:
        noun += f" in {low}..{high}" if kind is int else f" in [{low}, {high}]"
    elif above is not None and high is not None:
        noun += f" in ({above}, {high}]"
    elif low is not None:
        noun += f" >= {low}"
    elif above is not None:
        noun += f" > {above}"
    return noun + (" or None" if meta["optional"] else "")


def check_fields(config) -> None:
    """The one check of every field declared with a `kind`: its type (a bool is no number, a number is finite)
    and its bounds; ValueError naming the option by its flat name, what it must be and what it got."""
    for f in dataclasses.fields(config):
        meta = f.metadata
        kind = meta.get("kind")
        if kind is None:
            continue
        value = getattr(config, f.name)
        if value is None and meta["optional"]:
            continue
        if kind is bool:
            fits = isinstance(value, bool)
        elif kind is str:
            fits = isinstance(value, str)
        else:
            fits = not isinstance(value, bool) and isinstance(value, int if kind is int else (int, float)) and \
                math.isfinite(value) and (meta["low"] is None or value >= meta["low"]) and \
                (meta["above"] is None or value > meta["above"]) and (meta["high"] is None or value <= meta["high"])
        if not fits:
            raise ValueError(f"{meta['name'] or f.name} must be {_wanted(meta)}, got {value!r}")


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
    size: int = option(128, "tokens a chunk (fixed, adaptive) or at most (semantic); >= 8", name="chunk_size",
                       kind=int, low=8)
    window: int = option(16, "adaptive: how far (tokens) a cut may move to a sentence or line break",
                         name="chunk_window", kind=int, low=0)

    def validate(self) -> None:
        _check_choice("chunking", self.mode, CHUNKING_MODES)
        check_fields(self)
        if self.mode == "adaptive" and not self.window < self.size // 2:
            raise ValueError(f"adaptive window must be in [0, chunk_size/2), got {self.window!r}")


@dataclass(frozen=True)
class RepairConfig:
    """Seam repair for APPROXIMATE hits (engine.approx)."""

    mode: str = option("selective", "seam repair of APPROXIMATE hits (chosen by measurement)", choices=REPAIR_MODES,
                       name="repair")
    selective_tokens: int = option(16, "selective: tokens recomputed after each seam", kind=int, low=0)
    selective_before: int = option(0, "selective: reused tokens recomputed just before each seam", kind=int, low=0)
    blend_ratio: float = option(0.15, "cacheblend: share of reused tokens recomputed past the probe layer",
                                kind=float, low=0.0, high=1.0)
    probe_layer: int = option(1, "cacheblend: the layer whose value deviation picks those tokens", kind=int, low=0)
    blend_seam_tokens: int = option(0, "cacheblend: also always recompute this many tokens after each seam",
                                    kind=int, low=0)
    blend_select: str = option("deviation", "cacheblend: which reused tokens are recomputed: the most deviating at "
                                            "the probe layer, or (to diagnose the selection) a random choice of as "
                                            "many", choices=BLEND_SELECTIONS)

    def validate(self) -> None:
        _check_choice("repair", self.mode, REPAIR_MODES)
        _check_choice("blend_select", self.blend_select, BLEND_SELECTIONS)
        check_fields(self)


@dataclass(frozen=True)
class KVQuantConfig:
    """How each tier stores KV: "none" (as computed), "int8" or "int4" (KIVI, engine.kv.kv_quant).

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


@dataclass(frozen=True)
class ReuseConfig:
    """Which KV a request reuses, and the chunks it is kept in (engine.reuse): the mode, how prompts are cut
    (ChunkingConfig) and how APPROXIMATE hits are repaired (RepairConfig)."""

    mode: str = option("chunk", "which KV is reused ('approx' moves documents' KV and may change answers: "
                                "docs/engine.md)", choices=REUSE_MODES, name="reuse")
    chunking: ChunkingConfig = option(factory=ChunkingConfig, help="how prompts are cut into chunks (below)")
    repair: RepairConfig = option(factory=RepairConfig, help="seam repair for reuse='approx' (below)")

    def validate(self) -> None:
        _check_choice("reuse", self.mode, REUSE_MODES)
        self.chunking.validate()
        self.repair.validate()


@dataclass(frozen=True)
class TierConfig:
    """Where reused KV is kept (engine.kv.tiered_store): the device, host RAM and disk tiers' budgets, how each
    stores KV, what is evicted first, and the shared tier (engine.kv.remote_tier)."""

    cache_bytes: int | None = option(None, "the device tier's KV budget (the GPU, or RAM on a CPU-only machine); "
                                           "None: a quarter of free VRAM, or without a GPU 2/3 of the RAM budget "
                                           "(cpu_cache_bytes)", flags=("--gpu-cache-bytes",), kind=int,
                                     low=0, optional=True)
    cpu_cache_bytes: int | None = option(None, "the host RAM tier's budget; None: the RAM budget, the least of "
                                         "10% of RAM, 25% of the RAM free at start and 4 GiB (without a GPU a "
                                         "third of it, the device tier the rest), 0: off",
                                         kind=int, low=0, optional=True)
    disk_cache_bytes: int | None = option(None, "the disk tier's budget; None: sized from the disk, 0: off",
                                          kind=int, low=0, optional=True)
    disk_cache_dir: str | None = option(None, "the disk tier's folder; None: engine.kv.disk.default_cache_dir()",
                                        kind=str, optional=True)
    disk_busy_timeout_s: float = option(30.0, "how long a disk index write waits for another process's lock",
                                        kind=float, above=0)
    kv_quant: KVQuantConfig = option(factory=KVQuantConfig, help="KV quantization per tier (below), or one mode "
                                     "for host RAM and disk; lossless by default (int8/int4 hits are reported as "
                                     "QUANTIZED)", choices=KV_QUANT_MODES)
    eviction: str = option("importance-lru", "eviction policy (importance-lru measured +12% hit rate over LRU: "
                                             "bench/kv_tiers.py)", choices=EVICTION_POLICIES)
    # The shared KV tier (engine.kv.remote_tier). A read may take as long as the prefill it saves (the engine's
    # measured prefill rate times the tokens it restores), at least remote_timeout_s, at most remote_max_wait_s.
    remote_cache: str | None = option(None, "the shared KV tier: a redis://, rediss:// or unix:// URL of a Redis "
                                            "or Valkey store; None: off", kind=str, optional=True)
    remote_timeout_s: float = option(0.25, "a shared store silent this long while an answer is awaited is "
                                           "failing; also the least a read may take", flags=("--remote-timeout",),
                                      kind=float, above=0)
    remote_max_wait_s: float = option(10.0, "the longest a read of the shared tier may take, however much "
                                            "prefill it saves", flags=("--remote-max-wait",), kind=float, above=0)
    remote_retry_s: float = option(5.0, "after a failure the shared store is left alone this long", kind=float,
                                   above=0)
    remote_max_value_bytes: int | None = option(None, "shared-tier values longer than this are refused unread; "
                                                      "None: the most one chunk's KV and header can take",
                                                kind=int, low=1, optional=True)

    def validate(self) -> None:
        _check_choice("eviction", self.eviction, EVICTION_POLICIES)
        check_fields(self)
        self.kv_quant.validate()
        if self.remote_cache is not None and self.remote_cache.split("://", 1)[0] not in REMOTE_SCHEMES:
            raise ValueError("remote_cache must be a redis://, rediss:// or unix:// URL or None, got "
                             f"{self.remote_cache.rsplit('@', 1)[-1]!r}")  # never the password
        if self.remote_max_wait_s < self.remote_timeout_s:
            raise ValueError(f"remote_max_wait_s ({self.remote_max_wait_s!r}) must be at least remote_timeout_s "
                             f"({self.remote_timeout_s!r})")


@dataclass(frozen=True)
class DecodeConfig:
    """How the request being answered runs: its live KV (engine.paged), speculative drafts (engine.speculative),
    prefill pieces (engine.batching) and CUDA graphs (engine.graph_decode)."""

    live_kv_bytes: int | None = option(None, "device bytes for the live KV of the request being generated; "
                                             "beyond it cold pages spill to host RAM (engine.paged); None: no limit",
                                       kind=int, low=1, optional=True)
    live_page_tokens: int = option(128, "tokens per spilled page", kind=int, low=1)
    # On by default: `python -m bench speculative` measured 1.9-2.0x on quoting answers, 1.2-1.4x on needle
    # questions and 0.96-0.99x on free chat, the same greedy text everywhere (float and int4 weights).
    speculative: str | None = option("prompt-lookup", "drafts checked in the forward that feeds each token: "
                                                      "'prompt-lookup' (from the context), 'draft-model' (from "
                                                      "the load's draft model), or None (off)",
                                     choices=SPECULATIVE_MODES)
    num_draft: int = option(4, "tokens drafted at most per forward", kind=int, low=1, high=32)
    # So a request joining a batch stalls the others' decode steps for one piece at a time (engine.batching).
    prefill_piece_tokens: int | None = option(256, "computed prompt runs are forwarded in pieces ending at "
                                                   "multiples of this; the same pieces alone or batched; None: one "
                                                   "pass", kind=int, low=1, optional=True)
    cuda_graphs: bool = option(True, "on a CUDA device, one-token decode steps replay a captured CUDA graph "
                                     "(engine.graph_decode) where the model allows it", kind=bool)

    def validate(self) -> None:
        _check_choice("speculative", self.speculative, SPECULATIVE_MODES)
        check_fields(self)


@dataclass(frozen=True)
class EngineConfig:
    """What an engine does with the model it serves, in three parts: which KV it reuses (`reuse`), where that KV
    is kept (`tiers`) and how answers are decoded (`decode`). `KVBoost(model, tokenizer, config)`;
    from_pretrained's keywords fill it, and `EngineConfig.of(chunk_size=64, ...)` builds one from the same flat
    names."""

    reuse: ReuseConfig = option(factory=ReuseConfig, help="which KV is reused, how prompts are chunked and "
                                                          "seams repaired (below)")
    tiers: TierConfig = option(factory=TierConfig, help="where reused KV is kept: device, host RAM, disk and "
                                                        "shared tiers (below)")
    decode: DecodeConfig = option(factory=DecodeConfig, help="how answers are decoded: live KV, speculation, "
                                                             "prefill pieces, CUDA graphs (below)")

    @classmethod
    def of(cls, **flat) -> "EngineConfig":
        """The default config with the options `flat` names (their flat names, options(): `reuse="off"`,
        `chunk_size=64`, `cache_bytes=0`), validated as from_pretrained's keywords are; a name that is no engine
        option is a TypeError naming it."""
        loading = sorted(name for name in flat for opt in options().values()
                         if opt.owner is LoadOptions and name in (opt.name, *opt.aliases))
        if loading:
            raise TypeError(f"{loading} are load options (LoadOptions), not engine options")
        return split_options(flat)[1]

    def validate(self) -> None:
        self.reuse.validate()
        self.tiers.validate()
        self.decode.validate()


MAX_TOP_LOGPROBS = 20  # the most alternatives a token's logprobs list (OpenAI's bound)


@dataclass(frozen=True)
class SamplingConfig:
    """How one answer is sampled (the keywords of generate / chat / stream)."""

    max_new_tokens: int = option(128, "the answer's length at most, in tokens", kind=int, low=1)
    temperature: float = option(0.0, "0 (or below 1e-30): greedy; above: sampling at this temperature", kind=float,
                                low=0)
    top_p: float = option(1.0, "nucleus sampling: the smallest set of tokens holding this probability", kind=float,
                          above=0, high=1)
    top_k: int = option(0, "sample among the k likeliest tokens only; 0: all", kind=int, low=0)
    repetition_penalty: float = option(1.0, "divides the logits of tokens already in the prompt or answer",
                                       kind=float, above=0)
    stop: tuple[str, ...] = option((), "strings that end the answer (not included in it)")
    seed: int | None = option(None, "the sampling seed; None: a fresh one each request", kind=int, optional=True)
    logprobs: int | None = option(None, "report each answer token's log-probability (the log-softmax of the raw "
                                        "logits) with this many likeliest tokens at its position; None: none",
                                  kind=int, low=0, high=MAX_TOP_LOGPROBS, optional=True)

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
        check_fields(self)
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise ValueError(f"stop strings must be non-empty strings, got {text!r}")


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
                                          "device and are copied in one at a time before they run", kind=bool)
    weight_budget_bytes: int | None = option(None, "layer streaming: device bytes for the weights; None: 90% of "
                                                   "free VRAM (CUDA) or of available RAM (CPU)", kind=int, low=0,
                                             optional=True)
    stream_slots: int = option(STREAM_SLOTS, "layer streaming: device slots streamed layers are copied into",
                               kind=int, low=1)
    draft_model: str | None = option(None, "a smaller model of the same tokenizer that drafts tokens (a source "
                                           "like the model's; implies speculative='draft-model')", kind=str,
                                     optional=True)

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
        check_fields(self)


@dataclass(frozen=True)
class Option:
    """One option under its flat name: the dataclass (`owner`) and field path it fills, its field."""

    name: str
    owner: type  # LoadOptions or EngineConfig
    path: tuple[str, ...]  # field names from the owner down, e.g. ("reuse", "chunking", "size")
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
            out += _flatten(owner, nested, path + (f.name,))  # reuse, tiers, decode, chunking, repair
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
