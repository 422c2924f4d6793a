"""Will a model fit this machine? Weight bytes in the format the engine will hold them, plus the KV cache at a
chosen context length, against free GPU memory (CUDA) or the RAM the OS says is available.

    green   weights + KV fit on the device (GPU memory, or RAM on a CPU-only machine)
    yellow  they fit only with layer streaming (int4 weights) or in RAM on the CPU of a GPU machine
    red     they do not fit

The need is (weights + KV) x OVERHEAD, the rest being activations and allocator slack. Weights come from
engine.weights.weight_sizes (the model built from its config on the meta device) for a safetensors or AWQ folder; a GGUF
file, before it is downloaded, is sized from its header (read from the hub in memory): its file size stands for
its int4 size (Weights: int4 reads Q4_0/Q4_1 as they are and re-quantizes other types), its parameter count
times the float dtype for the float it is dequantized to under Weights: auto / float. KV per token is
2 (K and V) x layers x KV heads x head dim x the float dtype's bytes, every layer counted at full context (an
upper bound for sliding-window layers).
"""

from __future__ import annotations

import json
import math
import struct
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine.weights import loader, weight_sizes
from engine.weights.stream_setup import available_memory

OVERHEAD = 1.10
STREAM_SLOTS = 2  # decoder layers resident at once while streaming (engine.weights.streaming's default slot count)
GGUF_HEADER_MAX_BYTES = 16 << 20  # metadata (the vocabulary is most of it) and tensor table; 256k vocabularies fit


@dataclass(frozen=True)
class Fit:
    level: str  # "green" | "yellow" | "red"
    summary: str  # one line: where it would run, or why it does not fit
    memory: str  # which memory `available_bytes` is: "GPU memory (cuda:0)" or "RAM"
    available_bytes: int
    ram_available_bytes: int  # RAM, also when `memory` is the GPU's
    weight_bytes: int
    weight_format: str  # "float32", "bfloat16", "int4", ...
    kv_bytes_per_token: int
    context_tokens: int
    streamed_resident_bytes: int | None  # resident weights with layer streaming (int4 only), else None
    notes: tuple[str, ...] = ()

    @property
    def kv_bytes(self) -> int:
        return self.kv_bytes_per_token * self.context_tokens

    @property
    def need_bytes(self) -> int:
        return int((self.weight_bytes + self.kv_bytes) * OVERHEAD)

    def describe(self) -> str:
        """The numbers, for a tooltip or a terminal."""
        lines = [self.summary,
                 f"weights: {human_bytes(self.weight_bytes)} ({self.weight_format})",
                 f"KV cache: {human_bytes(self.kv_bytes)} at {self.context_tokens} tokens "
                 f"({human_bytes(self.kv_bytes_per_token)} per token)",
                 f"needs about {human_bytes(self.need_bytes)} with {OVERHEAD - 1:.0%} for activations",
                 f"{self.memory}: {human_bytes(self.available_bytes)} free"]
        if not self.memory.startswith("RAM"):
            lines.append(f"RAM: {human_bytes(self.ram_available_bytes)} available")
        if self.streamed_resident_bytes is not None:
            lines.append(f"with layer streaming: about {human_bytes(self.streamed_resident_bytes)} of weights resident")
        return "\n".join(lines + list(self.notes))

    def to_dict(self) -> dict:
        return {**asdict(self), "kv_bytes": self.kv_bytes, "need_bytes": self.need_bytes,
                "description": self.describe()}


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, element_size: int) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * element_size


def judge(weight_bytes: int, kv_per_token: int, context_tokens: int, *, weight_format: str,
          streamed_resident_bytes: int | None = None, device: str = "auto", notes=(),
          available: tuple[int, int] | None = None) -> Fit:
    """The fit level for these sizes; `available`: (device bytes, RAM bytes) instead of asking the machine."""
    dev = loader.pick_device(device)
    if available is None:
        ram = available_memory(torch.device("cpu"))
        available = (available_memory(dev) if dev.type == "cuda" else ram, ram)
    device_free, ram = available
    memory = f"GPU memory ({dev})" if dev.type == "cuda" else "RAM"
    kv = kv_per_token * context_tokens
    need = (weight_bytes + kv) * OVERHEAD
    streamed_need = None if streamed_resident_bytes is None else (streamed_resident_bytes + kv) * OVERHEAD
    if need <= device_free:
        level, summary = "green", f"fits in {memory} with its KV cache"
    elif streamed_need is not None and streamed_need <= device_free and (dev.type == "cpu" or weight_bytes <= ram):
        where = "decoder layers read from the mapped file" if dev.type == "cpu" else "decoder layers copied from RAM"
        level, summary = "yellow", f"fits in {memory} only with layer streaming ({where}; slower)"
    elif dev.type == "cuda" and need <= ram:
        level, summary = "yellow", "does not fit in GPU memory; fits in RAM (runs on the CPU)"
    else:
        level, summary = "red", (f"does not fit: needs about {human_bytes(need)}, {memory} has "
                                 f"{human_bytes(device_free)} free")
    return Fit(level, summary, memory, int(device_free), int(ram), int(weight_bytes), weight_format, int(kv_per_token),
               int(context_tokens), streamed_resident_bytes, tuple(notes))


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _config_kv(config: dict, element: int) -> int:
    text = config.get("text_config") or config  # multimodal configs keep the decoder's numbers apart
    heads = int(text["num_attention_heads"])
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or text["hidden_size"] // heads)
    return kv_bytes_per_token(int(text["num_hidden_layers"]), kv_heads, head_dim, element)


def _held(sizes: dict, weights: str) -> str:
    """Which of weight_sizes' figures the engine holds under Weights: `weights`
    (engine.weights.loader.WEIGHT_FORMATS)."""
    if weights == "int4" or (weights == "auto" and sizes["awq"]):
        return "int4"
    return "float"


def fit_config(config: dict, *, context_tokens: int = 4096, weights: str = "auto", device: str = "auto",
               available: tuple[int, int] | None = None) -> Fit:
    """The fit of a safetensors or AWQ model with this config.json (as a dict)."""
    with tempfile.TemporaryDirectory() as folder:  # weight_sizes.estimate reads a model folder's config
        (Path(folder) / "config.json").write_text(json.dumps(config), encoding="utf-8")
        sizes = weight_sizes.estimate(folder, device=device)
    return _fit_sizes(sizes, _config_kv(config, _element_size(getattr(torch, sizes["dtype"]))),
                      int((config.get("text_config") or config)["num_hidden_layers"]), context_tokens, weights,
                      device, available)


def fit_local(source, *, context_tokens: int = 4096, weights: str = "auto", device: str = "auto",
              available: tuple[int, int] | None = None) -> Fit:
    """The fit of a downloaded model (a folder or a .gguf file; engine.weights.weight_sizes.estimate)."""
    sizes = weight_sizes.estimate(source, device=device)
    config = loader.read_config(loader.resolve_source(source)).to_dict()
    return _fit_sizes(sizes, _config_kv(config, _element_size(getattr(torch, sizes["dtype"]))),
                      int((config.get("text_config") or config)["num_hidden_layers"]), context_tokens, weights,
                      device, available)


def _fit_sizes(sizes: dict, kv_per_token: int, num_layers: int, context_tokens, weights, device, available) -> Fit:
    held = _held(sizes, weights)
    weight = sizes[held]
    streamed = None
    if held == "int4":  # the layers' int4 share, STREAM_SLOTS of them at a time, plus what is outside the layers
        per_layer = (sizes["int4"] - sizes["outside_layers"]) / max(1, num_layers)
        streamed = int(sizes["outside_layers"] + STREAM_SLOTS * per_layer)
    fmt = f"int4 (group {sizes['group_size']})" if held == "int4" else sizes["dtype"]
    return judge(weight, kv_per_token, context_tokens, weight_format=fmt, streamed_resident_bytes=streamed,
                 device=device, available=available)


def fit_gguf(file_size: int, header: dict, *, context_tokens: int = 4096, weights: str = "auto",
             device: str = "auto", available: tuple[int, int] | None = None) -> Fit:
    """The fit of a GGUF file of `file_size` bytes with this header (read_gguf_header)."""
    meta = header["metadata"]
    arch = meta.get("general.architecture", "llama")
    dtype = loader.pick_dtype("auto", loader.pick_device(device))
    element = _element_size(dtype)

    def number(key, default=None):
        value = meta.get(f"{arch}.{key}", default)
        return max(value) if isinstance(value, list) else value  # per-layer arrays: the largest

    layers = int(number("block_count"))
    heads = int(number("attention.head_count"))
    kv_heads = int(number("attention.head_count_kv", heads))
    head_dim = int(number("attention.key_length", 0) or number("embedding_length") // heads)
    kv = kv_bytes_per_token(layers, kv_heads, head_dim, element)
    params, layer_params = header["num_params"], header["layer_params"]
    if weights == "int4":
        weight, fmt = file_size, "int4"
        notes = ["the GGUF file size stands for the int4 size (Q4_0/Q4_1 are read as they are, other types "
                 "re-quantized at load)"]
        outside = (params - layer_params) * element  # embedding and head, dequantized to the float dtype
        streamed = int(outside + STREAM_SLOTS * file_size * layer_params / max(1, params) / max(1, layers))
    else:
        weight, fmt = params * element, str(dtype).replace("torch.", "")
        notes = [f"GGUF weights are dequantized to {fmt} at load; Weights: int4 holds about the file size "
                 f"({human_bytes(file_size)})"]
        streamed = None
    return judge(weight, kv, context_tokens, weight_format=fmt, streamed_resident_bytes=streamed, device=device,
                 notes=notes, available=available)


# -- the GGUF header -----------------------------------------------------------------------------------------
# value type -> struct format (8: string, 9: array); little-endian, GGUF v2/v3
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_KEEP_ARRAY = 64  # arrays longer than this (the vocabulary, merges, scores) are skipped, not kept


class _Reader:
    def __init__(self, data: bytes):
        self.data = memoryview(data)
        self.pos = 0

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.data):
            raise ValueError(f"the GGUF header goes past the {len(self.data)} bytes read")
        block = self.data[self.pos:self.pos + n]
        self.pos += n
        return block

    def unpack(self, fmt: str):
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return bytes(self.take(self.unpack("Q"))).decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind == 8:
            return self.string()
        if kind == 9:
            item, count = self.unpack("I"), self.unpack("Q")
            if item in _SCALAR and count > _KEEP_ARRAY:
                self.take(count * struct.calcsize(_SCALAR[item]))
                return None
            values = [self.value(item) for _ in range(count)]
            return values if count <= _KEEP_ARRAY else None
        if kind not in _SCALAR:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self.unpack(_SCALAR[kind])


def read_gguf_header(data: bytes) -> dict:
    """{"metadata": key -> value (long arrays as None), "num_params": elements of all tensors, "layer_params":
    elements of the decoder layers' tensors ("blk.*")} from the first bytes of a GGUF file. ValueError when they
    are not a GGUF header or do not hold all of it."""
    r = _Reader(data)
    if bytes(r.take(4)) != b"GGUF":
        raise ValueError("not a GGUF file (no GGUF magic)")
    version = r.unpack("I")
    if version < 2:
        raise ValueError(f"GGUF version {version} is too old (v2 or later)")
    num_tensors, num_kv = r.unpack("Q"), r.unpack("Q")
    metadata = {}
    for _ in range(num_kv):
        key = r.string()
        metadata[key] = r.value(r.unpack("I"))
    params = layer_params = 0
    for _ in range(num_tensors):
        name = r.string()
        dims = [r.unpack("Q") for _ in range(r.unpack("I"))]
        r.unpack("I")  # ggml type
        r.unpack("Q")  # data offset
        count = math.prod(dims)
        params += count
        layer_params += count if name.startswith("blk.") else 0
    return {"metadata": metadata, "num_params": params, "layer_params": layer_params}


def read_gguf_file_header(path, max_bytes: int = GGUF_HEADER_MAX_BYTES) -> dict:
    with open(path, "rb") as f:
        return read_gguf_header(f.read(max_bytes))

