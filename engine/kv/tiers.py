"""KV payloads as the tiers hold them, and the two in-memory tiers (device, host).

A payload is the KV of one store entry: per layer (k, v), each [1, H_kv, T, D]. A tier holds it either as
computed (kv_quant "none") or KIVI-quantized ("int8" / "int4", engine.kv.kv_quant): keys per channel in groups of
KEY_GROUP tokens, values per token in groups of the head dim, float16 scales/zeros when the KV's range fits
float16 (that is what makes int8 about 1.9x and int4 about 3.6x smaller than float16 KV).

The disk tier (engine.kv.disk) writes the same StoredKV to files. Which entry lives in which tier, and when it
moves, is the store's business (engine.kv.store); a tier only holds, measures and hands back payloads.

A payload read back from a file or from the shared store is checked against the running model's KVLayout before
use (KVLayout.mismatch): layer count, KV heads, head dim, dtype, and for a quantized tier every part's bits,
grouping, codes and stats shapes, exactly as encode_kv makes them. A checksum proves that bytes were not changed
on the way, not that whoever wrote them ran this model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

from ..ram_budget import RamBudget
from .kv_quant import QuantizedTensor, dequantize, quantize_kv

KV = tuple[tuple[torch.Tensor, torch.Tensor], ...]
QUANT_MODES = ("none", "int8", "int4")
BITS = {"int8": 8, "int4": 4}
KEY_GROUP = 128  # tokens per key group: one group per channel for a default-size chunk
FP16_SAFE = 60000.0  # largest |x| whose quantization stats still fit float16

Part = Union[torch.Tensor, QuantizedTensor]


@dataclass(frozen=True)
class StoredKV:
    layers: tuple[tuple[Part, Part], ...]
    quant: str
    num_tokens: int

    @property
    def nbytes(self) -> int:
        total = 0
        for k, v in self.layers:
            for part in (k, v):
                total += part.nbytes if isinstance(part, QuantizedTensor) else part.numel() * part.element_size()
        return total


@dataclass(frozen=True)
class KVLayout:
    """The KV of one model: per layer k and v, each [1, num_kv_heads, T, head_dim] in `dtype`."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of_model(cls, model) -> "KVLayout":
        """From the model's config (what its attention layers allocate), before any KV was computed."""
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        heads = config.num_attention_heads
        return cls(config.num_hidden_layers, getattr(config, "num_key_value_heads", None) or heads,
                   getattr(config, "head_dim", None) or config.hidden_size // heads, model.dtype)

    @classmethod
    def of_stored(cls, stored: StoredKV) -> "KVLayout | None":
        """The layout a payload's first part claims (to check its other parts against, where no model says)."""
        part = stored.layers[0][0] if stored.layers else None
        shape = tuple(getattr(part, "shape", ()))
        if len(shape) != 4 or not isinstance(getattr(part, "dtype", None), torch.dtype):
            return None
        return cls(len(stored.layers), shape[1], shape[3], part.dtype)

    @classmethod
    def of_kv(cls, kv: KV) -> "KVLayout | None":
        """The layout `kv` has, or None when its layers differ from each other (no one layout describes it)."""
        k = kv[0][0]
        layout = cls(len(kv), k.shape[1], k.shape[3], k.dtype)
        shape = (1, layout.num_kv_heads, k.shape[2], layout.head_dim)
        same = all(tuple(t.shape) == shape and t.dtype == k.dtype for layer in kv for t in layer)
        return layout if same and k.dim() == 4 else None

    def payload_bytes(self, quant: str, num_tokens: int) -> int:
        """The most bytes a payload of `num_tokens` tokens takes in `quant` (float32 stats, the larger kind)."""
        heads, dim = self.num_kv_heads, self.head_dim
        if quant == "none":
            return self.num_layers * 2 * heads * num_tokens * dim * self.dtype.itemsize
        total = 0
        for x, length, group in ((dim, num_tokens, KEY_GROUP), (num_tokens, dim, dim)):
            groups = -(-length // group)
            codes = heads * x * groups * group
            total += (codes + 1) // 2 if quant == "int4" else codes
            total += 2 * heads * x * groups * 4  # scale and zero
        return self.num_layers * total

    def mismatch(self, stored: StoredKV, quant: str, num_tokens: int) -> str | None:
        """Why `stored` is not KV of this layout for `num_tokens` tokens as a `quant` tier holds it; None if it is."""
        if stored.quant != quant:
            return f"kv_quant {stored.quant!r}, this tier holds {quant!r}"
        if stored.num_tokens != num_tokens:
            return f"{stored.num_tokens} tokens, the entry has {num_tokens}"
        if len(stored.layers) != self.num_layers:
            return f"{len(stored.layers)} layers, the model has {self.num_layers}"
        shape = (1, self.num_kv_heads, num_tokens, self.head_dim)
        for i, (k, v) in enumerate(stored.layers):
            for name, part, axis, group in (("k", k, "channel", KEY_GROUP), ("v", v, "token", self.head_dim)):
                why = self._part_mismatch(part, shape, quant, axis, group)
                if why is not None:
                    return f"layer {i} {name}: {why}"
        return None

    def _part_mismatch(self, part, shape: tuple, quant: str, axis: str, group: int) -> str | None:
        if quant == "none":
            if not isinstance(part, torch.Tensor):
                return f"a {type(part).__name__} in a lossless payload"
            if tuple(part.shape) != shape or part.dtype != self.dtype:
                return f"{tuple(part.shape)} {part.dtype}, the model's is {shape} {self.dtype}"
            return None
        if not isinstance(part, QuantizedTensor):
            return f"a {type(part).__name__} in a {quant} payload"
        if (part.bits, part.axis, part.group_size) != (BITS[quant], axis, group):
            return f"{part.bits} bits per {part.axis} in groups of {part.group_size}, this tier ({quant}) " \
                   f"writes {BITS[quant]} bits per {axis} in groups of {group}"
        if tuple(part.shape) != shape or part.dtype != self.dtype:
            return f"quantized {tuple(part.shape)} {part.dtype}, the model's is {shape} {self.dtype}"
        # codes in the grouped layout [1, H, X, P] (X the axis not grouped, P the grouped one padded to the group)
        x, length = (shape[3], shape[2]) if axis == "channel" else (shape[2], shape[3])
        groups = -(-length // group)
        codes = shape[1] * x * groups * group
        codes = (codes + 1) // 2 if part.bits == 4 else codes
        data = part.data
        if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or tuple(data.shape) != (codes,):
            return f"codes {_described(data)}, expected ({codes},) torch.uint8"
        stats = (1, shape[1], x, groups)
        for name, t in (("scale", part.scale), ("zero", part.zero)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != stats or t.dtype != part.scale.dtype \
                    or t.dtype not in (torch.float16, torch.float32):
                return f"{name} {_described(t)}, expected {stats} float16 or float32 like the scale"
        return None


def _described(t) -> str:
    return f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__


def encode_kv(kv: KV, quant: str, device: torch.device, pin: bool = False) -> StoredKV:
    """`kv` as a tier on `device` keeps it. Views are copied (a view would pin the whole source cache in
    memory); contiguous tensors already on `device` are kept as they are, so do not modify them later."""
    if quant not in QUANT_MODES:
        raise ValueError(f"kv_quant must be one of {QUANT_MODES}, got {quant!r}")
    num_tokens = kv[0][0].shape[2]
    layers = []
    for k, v in kv:
        if quant == "none":
            parts = (_own(k, device), _own(v, device))
        else:
            peak = max(float(k.abs().max()), float(v.abs().max())) if k.numel() else 0.0
            stats = torch.float16 if peak < FP16_SAFE or k.dtype == torch.float16 else None
            qk, qv = quantize_kv(k, v, BITS[quant], group_size=KEY_GROUP, value_group_size=v.shape[-1],
                                 stats_dtype=stats)
            parts = (_move(qk, device), _move(qv, device))
        if pin:
            parts = tuple(_pin(p) for p in parts)
        layers.append(parts)
    return StoredKV(tuple(layers), quant, num_tokens)


def _own(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.device == device and t.is_contiguous() and t.storage_offset() == 0 \
            and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.to(device).contiguous().clone() if t.device == device else t.to(device).contiguous()


def decode_kv(stored: StoredKV, device: torch.device) -> KV:
    """The payload as per-layer (k, v) tensors on `device`, in the dtype it was computed in."""
    out = []
    for k, v in stored.layers:
        out.append((_materialize(k, device), _materialize(v, device)))
    return tuple(out)


def _materialize(part: Part, device: torch.device) -> torch.Tensor:
    if isinstance(part, QuantizedTensor):
        return dequantize(_move(part, device))
    # Non-blocking only toward the GPU: a GPU -> CPU copy returns before the bytes are there, and the caller
    # reads them on the CPU right away (quantizes them, writes them to a file).
    return part.to(device, non_blocking=device.type == "cuda")


def _move(q: QuantizedTensor, device: torch.device) -> QuantizedTensor:
    if q.data.device == device:
        return q
    return QuantizedTensor(q.data.to(device), q.scale.to(device), q.zero.to(device), q.bits, q.axis, q.group_size,
                           q.shape, q.dtype)


def _pin(part: Part) -> Part:
    if isinstance(part, QuantizedTensor):
        return QuantizedTensor(part.data.pin_memory(), part.scale.pin_memory(), part.zero.pin_memory(), part.bits,
                               part.axis, part.group_size, part.shape, part.dtype)
    return part.pin_memory()


class MemoryTier:
    """Payloads in memory on one device, within a byte budget (the store decides what to evict)."""

    def __init__(self, name: str, budget_bytes: int, device: torch.device, quant: str = "none", pin: bool = False,
                 budget_rule: str | None = None):
        """`budget_rule`: where the budget came from, in the user's words ("default: 10% of 23.4 GiB RAM")."""
        if quant not in QUANT_MODES:
            raise ValueError(f"kv_quant for the {name} tier must be one of {QUANT_MODES}, got {quant!r}")
        self.name = name
        self.budget_bytes = budget_bytes
        self.budget_rule = budget_rule
        self.device = device
        self.quant = quant
        self.pin = pin
        self.num_bytes = 0
        self._payloads: dict[bytes, StoredKV] = {}

    def __contains__(self, key: bytes) -> bool:
        return key in self._payloads

    def __len__(self) -> int:
        return len(self._payloads)

    def fits(self, num_bytes: int) -> bool:
        return self.num_bytes + num_bytes <= self.budget_bytes

    def encode(self, kv: KV) -> StoredKV:
        return encode_kv(kv, self.quant, self.device, self.pin)

    def put(self, key: bytes, stored: StoredKV) -> None:
        assert key not in self._payloads, "a key is put once per tier"
        self._payloads[key] = stored
        self.num_bytes += stored.nbytes

    def get(self, key: bytes, device: torch.device) -> KV:
        return decode_kv(self._payloads[key], device)

    def remove(self, key: bytes) -> StoredKV:
        stored = self._payloads.pop(key)
        self.num_bytes -= stored.nbytes
        return stored


# Without a GPU both memory tiers are RAM and share one budget (engine.ram_budget.default_ram_budget): the device tier,
# read without a copy, two thirds of it; the overflow tier behind it the rest.
CPU_DEVICE_SHARE = (2, 3)


def _share_of(ram: RamBudget, share: tuple[int, int]) -> tuple[int, str]:
    return ram.bytes * share[0] // share[1], (f"default: {share[0]}/{share[1]} of {ram.bytes / (1 << 30):.1f} GiB "
                                              f"({ram.rule})")


def default_device_budget(device: torch.device, ram: RamBudget) -> tuple[int, str]:
    """(bytes, why): a quarter of free device memory on CUDA; on CPU the device tier's share of `ram`."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * 0.25), f"default: 25% of the {free / (1 << 30):.1f} GiB free on {device}"
    return _share_of(ram, CPU_DEVICE_SHARE)


def default_host_budget(device: torch.device, ram: RamBudget) -> tuple[int, str]:
    """(bytes, why): host RAM behind the device: all of `ram` under a GPU; on a CPU-only machine (where the
    device tier is RAM already) what the device tier leaves of it."""
    if device.type == "cuda":
        return ram.bytes, f"default: {ram.rule}"
    device_bytes, _ = _share_of(ram, CPU_DEVICE_SHARE)
    num, den = CPU_DEVICE_SHARE
    return ram.bytes - device_bytes, _share_of(ram, (den - num, den))[1]
