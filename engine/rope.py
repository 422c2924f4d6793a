"""Exact re-rotation of cached keys between positions, for the RoPE variants transformers uses.

HF decoders cache keys after the rotary embedding. With cos/sin from the model's `rotary_emb`, which both carry
the variant's attention scaling s (yarn, longrope; 1 elsewhere):

    k_cached(p) = k * s*cos(p*f) + rotate_half(k) * s*sin(p*f) = s * R(p*f) k

for each frequency f of `inv_freq`, R(a) the 2-D rotation by angle a of the pair of dims f acts on. Rotations
compose, so

    R((q - p)*f) k_cached(p) = s * R(q*f) k = k_cached(q):

moving a key from p to q is a pure rotation by the position delta, with no scaling at all (s was applied once
when the key was computed and stays). Applying the model's own cos/sin for the delta would multiply by s again.

This holds exactly only while the model uses one fixed `inv_freq` for both positions. "dynamic" NTK recomputes
`inv_freq` from the sequence length beyond `max_position_embeddings`; "longrope" switches between short and long
factors at `original_max_position_embeddings`. `RopeParams` therefore records the range of context lengths
(1 + the largest position id of a forward pass) its `inv_freq` holds for, and `can_rerotate` checks both ends.

Only architectures whose attention applies RoPE in a layout checked by tests/engine/test_rope.py are accepted:
an unknown model could rotate other dims (MLA puts the rotary dims last) or use 3-D positions (M-RoPE), and a
silently wrong key is worse than no reuse.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Sequence

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

KV = tuple[tuple[torch.Tensor, torch.Tensor], ...]

# rope_type values whose cos/sin are e^{i*pos*inv_freq} times a constant, for a fixed inv_freq.
SUPPORTED_ROPE_TYPES = frozenset({"default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional"})

# Text model types whose attention rotates the first rotary_dim dims of each head with the rotary_emb cos/sin
# (rotate_half or interleaved pairs); each is exercised by the re-rotation identity test.
VERIFIED_MODEL_TYPES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text",
    "phi", "phi3", "stablelm", "starcoder2", "granite", "olmo2", "smollm3", "cohere", "glm",
})


@dataclass(frozen=True, eq=False)
class RopeParams:
    """What one layer's RoPE needs for re-rotation. Layers with identical RoPE share one object."""

    rope_type: str  # "none" for a NoPE layer (identity)
    inv_freq: torch.Tensor  # [rotary_dim // 2] float64, CPU: the frequencies the model multiplies positions by
    attention_scaling: float  # factor on the model's cos and sin; re-rotation never applies it (module docstring)
    interleaved: bool  # pairs (2i, 2i+1) (Cohere, GLM) instead of (i, i + rotary_dim // 2)
    min_context: int = 1  # inv_freq is exact for forward passes whose context length n
    max_context: int | None = None  # satisfies min_context <= n <= max_context (None: unbounded)

    @property
    def rotary_dim(self) -> int:
        """Leading dims of a head that are rotated; the rest (partial rotary) carry no position."""
        return 2 * self.inv_freq.numel()

    def holds_for(self, context_len: int) -> bool:
        return self.min_context <= context_len and (self.max_context is None or context_len <= self.max_context)


def can_rerotate(params: Sequence[RopeParams], source_len: int, target_len: int) -> bool:
    """Whether keys computed in a context of `source_len` tokens can be moved exactly into one of `target_len`.

    A context length is 1 + the largest position id of the forward pass that computes (or attends to) the keys."""
    return all(p.holds_for(source_len) and p.holds_for(target_len) for p in params)


# -- reading the model ---------------------------------------------------------------------------------------

def rope_params(model, context_len: int = 1) -> tuple[RopeParams, ...]:
    """RoPE parameters of each decoder layer of `model`, for forward passes of `context_len` tokens (longrope
    picks its short or long factors by it). Raises ValueError for a model re-rotation does not support."""
    config = model.config.get_text_config()
    if config.model_type not in VERIFIED_MODEL_TYPES:
        raise ValueError(
            f"re-rotation is not verified for model type {config.model_type!r}; supported: "
            f"{sorted(VERIFIED_MODEL_TYPES)}"
        )
    rotary = rotary_module(model)
    if rotary is None:
        raise ValueError(f"{type(model).__name__} has no rotary_emb module")
    interleaved = _is_interleaved(rotary)
    num_layers = config.num_hidden_layers
    per_type = isinstance(rotary.rope_type, dict)  # Gemma3: local and global layers differ
    layer_types = config.layer_types if per_type else [None] * num_layers
    uses_rope = getattr(config, "no_rope_layers", None) or [1] * num_layers  # SmolLM3: 0 marks a NoPE layer
    nope = RopeParams("none", torch.zeros(0, dtype=torch.float64), 1.0, interleaved)

    by_type: dict[str | None, RopeParams] = {}
    layers = []
    for layer_type, rotated in zip(layer_types, uses_rope):
        if not rotated or (per_type and layer_type not in rotary.rope_type):  # no rope_parameters: NoPE
            layers.append(nope)
            continue
        if layer_type not in by_type:
            by_type[layer_type] = _layer_params(rotary, layer_type, context_len, interleaved)
        layers.append(by_type[layer_type])
    return tuple(layers)


def rotary_module(model):
    """The rotary embedding module of a decoder: its `rotary_emb`, else (models that rotate inside each attention
    module) the first submodule of that name; None for models without RoPE (gpt2, ALiBi models)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    rotary = getattr(decoder, "rotary_emb", None)
    if rotary is not None:
        return rotary
    return next((module for name, module in model.named_modules() if name.endswith("rotary_emb")), None)


def _is_interleaved(rotary) -> bool:
    """Reads the layout off the modeling module's own rotate_half, applied to [0, 1, 2, 3]."""
    rotate_half = getattr(sys.modules[type(rotary).__module__], "rotate_half", None)
    if rotate_half is None:
        raise ValueError(f"{type(rotary).__module__} has no rotate_half; unknown RoPE layout")
    probe = rotate_half(torch.arange(4.0)).tolist()
    if probe == [-2.0, -3.0, 0.0, 1.0]:
        return False
    if probe == [-1.0, 0.0, -3.0, 2.0]:
        return True
    raise ValueError(f"unknown rotate_half layout in {type(rotary).__module__}: {probe}")


def _layer_params(rotary, layer_type: str | None, context_len: int, interleaved: bool) -> RopeParams:
    prefix = f"{layer_type}_" if layer_type else ""
    rope_type = rotary.rope_type[layer_type] if layer_type else rotary.rope_type
    settings = rotary.config.rope_parameters[layer_type] if layer_type else rotary.config.rope_parameters
    if rope_type not in SUPPORTED_ROPE_TYPES or settings.get("mrope_section"):
        raise ValueError(f"RoPE type {rope_type!r} is not supported for re-rotation")
    # The init-time frequencies: the live `inv_freq` buffer of dynamic/longrope changes with the last forward.
    inv_freq = getattr(rotary, f"{prefix}original_inv_freq")
    scaling = float(getattr(rotary, f"{prefix}attention_scaling"))
    min_context, max_context = 1, None
    if rope_type == "dynamic":
        # Below max_position_embeddings the module uses (or resets to) the original frequencies; at exactly that
        # length it keeps frequencies grown by an earlier, longer forward pass.
        max_context = rotary.original_max_seq_len - 1
    elif rope_type == "longrope":
        original_max = settings["original_max_position_embeddings"]
        if context_len > original_max:
            # The same call the model makes when a forward pass first exceeds the original length.
            inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](
                rotary.config, "cpu", seq_len=original_max + 1, layer_type=layer_type
            )
            min_context = original_max + 1
        else:
            max_context = original_max
    return RopeParams(rope_type, inv_freq.detach().to("cpu", torch.float64), scaling, interleaved,
                      min_context, max_context)


# -- the maths -----------------------------------------------------------------------------------------------

def delta_rotation(from_pos, to_pos, params: RopeParams, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the per-token rotation from `from_pos` to `to_pos`: float64 on the CPU, [T or 1, R/2].

    Positions are ints (the first position of a contiguous run: the delta is then the same for every token) or
    integer tensors [T]. Angles are formed in float64 from the exact integer delta, on the CPU because MPS has
    no float64."""
    delta = torch.as_tensor(to_pos, device="cpu") - torch.as_tensor(from_pos, device="cpu")
    if delta.is_floating_point():
        raise ValueError(f"positions must be integers, got dtype {delta.dtype}")
    delta = delta.reshape(-1)  # [T] or [1]
    if delta.numel() not in (1, num_tokens):
        raise ValueError(f"{delta.numel()} position deltas for {num_tokens} tokens")
    angles = delta.to(torch.float64)[:, None] * params.inv_freq[None, :]  # [T|1, R/2]
    return angles.cos(), angles.sin()


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _placed(t: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    # Cast before moving: float64 cannot live on MPS.
    return t.to(_compute_dtype(k.dtype)).to(k.device)


def apply_rotation(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, params: RopeParams) -> torch.Tensor:
    """Rotates the rotary dims of k by (cos, sin) from `delta_rotation`; other dims pass through untouched.

    k: [..., T, D]; cos, sin: [T|1, R/2]. Computes in float64 for float64 keys, float32 otherwise; returns k.dtype."""
    rotary_dim = params.rotary_dim
    if rotary_dim == 0:
        return k
    if k.shape[-1] < rotary_dim:
        raise ValueError(f"head dim {k.shape[-1]} is smaller than the rotary dim {rotary_dim}")
    cos, sin = _placed(cos, k), _placed(sin, k)
    rot = k[..., :rotary_dim].to(cos.dtype)
    if params.interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2:]
    y1 = x1 * cos - x2 * sin  # [..., T, R/2]
    y2 = x2 * cos + x1 * sin
    rotated = torch.stack((y1, y2), dim=-1).flatten(-2) if params.interleaved else torch.cat((y1, y2), dim=-1)
    return torch.cat((rotated.to(k.dtype), k[..., rotary_dim:]), dim=-1)


def rerotate_keys(k: torch.Tensor, from_pos, to_pos, params: RopeParams) -> torch.Tensor:
    """Cached keys k [..., T, D], computed at positions `from_pos`, as the model would have cached them at
    `to_pos` (ints: first position of the run; or integer tensors [T]). Exact within `can_rerotate`."""
    cos, sin = delta_rotation(from_pos, to_pos, params, k.shape[-2])
    return apply_rotation(k, cos, sin, params)


def rerotate_kv(kv: KV, from_pos, to_pos, params: Sequence[RopeParams]) -> KV:
    """A per-layer (k, v) payload, each [1, H_kv, T, D], moved from `from_pos` to `to_pos`. Values carry no
    position and are returned as they are; the rotation is built once per distinct RopeParams."""
    if len(kv) != len(params):
        raise ValueError(f"{len(kv)} KV layers but {len(params)} RoPE layer parameters")
    rotations: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    out = []
    for (k, v), p in zip(kv, params):
        if id(p) not in rotations:
            cos, sin = delta_rotation(from_pos, to_pos, p, k.shape[-2])
            rotations[id(p)] = _placed(cos, k), _placed(sin, k)
        out.append((apply_rotation(k, *rotations[id(p)], p), v))
    return tuple(out)
