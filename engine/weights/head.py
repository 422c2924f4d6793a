"""The output head and the embedding table in fewer bytes: int8 per output row, or int4 groups.

On a small model the head is a large share of what a decode step reads (SmolLM2-135M: 49152 x 576, 113 MB in
float32, a fifth of the model, read at every token), and a tied table holds the same weight a second time in
another role. Formats (HEAD_FORMATS):

- "float": as loaded.
- "int8": the head as `Int8Linear`: w = q * scale, q int8 in -127..127, one float scale per output row
  (symmetric, the row's largest |w| maps to 127). A tied table keeps its float rows for lookups.
- "int8+embedding": the same, and the table becomes an `Int8Embedding` over the same codes (the float table
  is freed: the model holds the int8 codes once).
- "int4" / "int4+embedding": the head as an Int4Linear (RTN groups), the table as an `Int4Embedding` with it.

Int8 matmul paths: "cpu_int8pack", torch's `_weight_int8pack_mm` (bfloat16 activations: its float32 variant
is a scalar loop, slower than the float32 matmul it replaces), and "reference" (dequantize to the activation
dtype, F.linear) everywhere else; the choice is made once at load, by a probe.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ..config import HEAD_FORMATS
from .gguf_blocks import BlockEmbedding, BlockLinear
from .int4 import (
    FAST_DTYPE,
    Int4Linear,
    check_group_size,
    dequantize_codes,
    layer_format,
    pack_nibbles,
    padded_features,
    pick_kernel,
    quantize_rtn,
    replace_module,
    shape_problem,
    unpack_nibbles,
)

INT8_KERNELS = ("reference", "cpu_int8pack")


def quantize_rows_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (codes int8 [out, in], scales float32 [out]); w ~ codes * scale, each element within
    scale / 2 of its value (an all-zero row gets scale 1)."""
    w = weight.detach().to(torch.float32)
    scales = w.abs().amax(dim=1) / 127
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return codes, scales


@functools.lru_cache(maxsize=None)
def int8_kernel_unavailable(kernel: str, device: str) -> str | None:
    """Why `kernel` cannot run on `device` (a probe against the reference), or None when it can."""
    if kernel == "reference":
        return None
    if kernel != "cpu_int8pack":
        raise ValueError(f"int8 kernel must be one of {INT8_KERNELS}, got {kernel!r}")
    if torch.device(device).type != "cpu":
        return f"cpu_int8pack runs on the CPU, not on {device}"
    if not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        return f"torch {torch.__version__} has no _weight_int8pack_mm"
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(48, 64, generator=gen), torch.randn(3, 64, generator=gen)
    try:
        got = Int8Linear.from_float(weight, None, kernel)(x)
    except (RuntimeError, NotImplementedError) as exc:
        return f"cpu_int8pack failed: {type(exc).__name__}: {exc}"
    want = Int8Linear.from_float(weight, None, "reference")(x)
    if not torch.allclose(got, want, rtol=0.02, atol=0.02 * float(want.abs().max())):
        return f"cpu_int8pack disagrees with the reference path (max error {(got - want).abs().max():.3g})"
    return None


def pick_int8_kernel(device: torch.device) -> tuple[str, str | None]:
    if device.type != "cpu":
        return "reference", f"no int8 kernel for {device.type} devices"
    reason = int8_kernel_unavailable("cpu_int8pack", "cpu")
    return ("reference", reason) if reason else ("cpu_int8pack", None)


class Int8Linear(nn.Module):
    """A linear layer over int8 rows: codes int8 [out, in], scales [out] (float32 for the reference path, the
    activation's bfloat16 for cpu_int8pack, which takes them in the activation dtype)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, kernel: str):
        super().__init__()
        assert kernel in INT8_KERNELS, kernel
        self.out_features, self.in_features = codes.shape
        self.kernel = kernel
        self.fallback_reason: str | None = None
        self.register_buffer("codes", codes.to(torch.int8).contiguous())
        dtype = FAST_DTYPE if kernel == "cpu_int8pack" else torch.float32
        self.register_buffer("scales", scales.to(dtype).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str) -> "Int8Linear":
        codes, scales = quantize_rows_int8(weight)
        return cls(codes, scales, bias, kernel)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.codes.to(torch.float32) * self.scales.to(torch.float32)[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "reference":
            return F.linear(x, self.dequantize(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        flat = x.reshape(-1, self.in_features).to(FAST_DTYPE).contiguous()
        y = torch.ops.aten._weight_int8pack_mm(flat, self.codes, self.scales).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}"


class Int8Embedding(nn.Module):
    """An embedding table over int8 rows (the head's codes): a lookup dequantizes only the rows it gathers.
    `embed_scale`: the factor a scaled table (Gemma's) multiplies its rows by, in `dtype`, as it does."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                 embed_scale: torch.Tensor | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = codes.shape
        self.dtype = dtype
        self.register_buffer("codes", codes)  # shared with the head: held once
        self.register_buffer("scales", scales)
        self.register_buffer("embed_scale", None if embed_scale is None else embed_scale.detach().clone())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1)  # [T] -> rows [T, embedding_dim]
        rows = self.codes[flat].to(torch.float32) * self.scales[flat].to(torch.float32)[:, None]
        return _scaled(rows.to(self.dtype), self.embed_scale).reshape(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 rows"


class Int4Embedding(nn.Module):
    """An embedding table held as canonical int4 rows (packed nibbles, scales, zeros, and offsets for GGUF Q4_1 /
    Q4_K rows): a lookup unpacks and dequantizes only the rows it gathers, in float32, then casts to `dtype`."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, embedding_dim: int,
                 dtype: torch.dtype, origin: str = "rtn", offsets: torch.Tensor | None = None,
                 embed_scale: torch.Tensor | None = None):
        super().__init__()
        self.num_embeddings, padded = codes.shape
        self.embedding_dim = embedding_dim
        self.group_size = padded // scales.shape[1]
        self.dtype = dtype
        self.origin = origin
        self.register_buffer("packed", pack_nibbles(codes).contiguous())
        self.register_buffer("scales", scales.to(torch.float32).contiguous())
        self.register_buffer("zeros", zeros.to(torch.uint8).contiguous())
        self.register_buffer("offsets", None if offsets is None else offsets.to(torch.float32).contiguous())
        self.register_buffer("embed_scale", None if embed_scale is None else embed_scale.detach().clone())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1)  # [T] -> rows [T, embedding_dim]
        offsets = None if self.offsets is None else self.offsets[flat]
        rows = dequantize_codes(unpack_nibbles(self.packed[flat]), self.scales[flat], self.zeros[flat],
                                self.embedding_dim, self.dtype, offsets)
        return _scaled(rows, self.embed_scale).reshape(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, group_size={self.group_size}"


def _scaled(rows: torch.Tensor, embed_scale: torch.Tensor | None) -> torch.Tensor:
    # as Gemma's scaled table: rows in the table's dtype times the scale cast to that dtype
    return rows if embed_scale is None else rows * embed_scale.to(rows.dtype)


def auto_head(model) -> str:
    """What head="auto" means for a loaded model: "int8+embedding" when its decoder layers are int4 and the
    int8 kernel runs on its device (measured on the embedded model, `python -m bench decode`: the same answers
    as the float head to a KL of 0.003, 98% of first tokens, the same needle accuracy, at half the resident
    bytes and ~15% faster decode), else "float" (float models stay as they are; on devices without an int8
    kernel the reference path would dequantize the whole head at every token)."""
    int4 = any(isinstance(m, Int4Linear) for m in model.modules())
    if not isinstance(model.get_output_embeddings(), nn.Linear):
        return "float"
    return auto_head_for(int4, model.get_output_embeddings().weight.device)


def auto_head_for(quantized_layers: bool, device: torch.device) -> str:
    """auto_head's rule before the head exists (a loader building it from a file): "int8+embedding" under
    quantized decoder layers where the int8 kernel runs on `device`, else "float"."""
    return "int8+embedding" if quantized_layers and pick_int8_kernel(device)[1] is None else "float"


def quantize_head(model, head: str = "int4", group_size: int = 32, kernel: str = "auto") -> dict:
    """The output head in `head` format (HEAD_FORMATS), in place; the int4 ones RTN at `group_size` on the int4
    `kernel`. With "int8" / "int4" a tied embedding table keeps the float weight for its lookups (the head's
    codes are a second, smaller copy); "+embedding" replaces the table too, and the float table is freed: a
    tied table by one over the head's own codes (held once), an untied one by its own weight quantized the same
    way. "float" leaves the model as it is. Returns {"head": format, "embedding": format,
    "reason": why not the fast kernel}."""
    if head not in HEAD_FORMATS:
        raise ValueError(f"head must be one of {HEAD_FORMATS}, got {head!r}")
    check_group_size(group_size)
    output, inputs = model.get_output_embeddings(), model.get_input_embeddings()
    if head == "float":
        return {"head": head_format(output), "embedding": head_format(inputs), "reason": None}
    if not isinstance(output, nn.Linear):
        raise ValueError(f"the output head of {type(model).__name__} is a {type(output).__name__}, not an nn.Linear")
    weight = output.weight.detach()
    tied = isinstance(inputs, nn.Embedding) and inputs.weight is output.weight
    if head.endswith("+embedding") and not isinstance(inputs, nn.Embedding):
        raise ValueError(f"the input table of {type(model).__name__} is a {type(inputs).__name__}, not an nn.Embedding")
    if head.startswith("int8"):
        path, reason = pick_int8_kernel(weight.device)
        codes, scales = quantize_rows_int8(weight)
        new_head = Int8Linear(codes, scales, output.bias, path)
    else:
        path, reason = pick_kernel(kernel, weight.device)
        problem = shape_problem(path, output.out_features, padded_features(output.in_features, group_size))
        if problem is not None:
            path, reason = "reference", problem
        codes, scales, zeros = quantize_rtn(weight, group_size)
        new_head = Int4Linear.from_codes(codes, scales, zeros, output.in_features, output.bias, path)
    new_head.fallback_reason = reason
    name = next(n for n, m in model.named_modules() if m is output)
    replace_module(model, name, new_head)
    model.config.tie_word_embeddings = False  # the head no longer shares a Parameter with the table
    if head.endswith("+embedding"):
        rows = weight if tied else inputs.weight.detach()
        if isinstance(new_head, Int8Linear):
            table_codes, table_scales = (new_head.codes, new_head.scales) if tied else quantize_rows_int8(rows)
            table = Int8Embedding(table_codes, table_scales, rows.dtype, getattr(inputs, "embed_scale", None))
        else:
            if not tied:
                codes, scales, zeros = quantize_rtn(rows, group_size)
            table = Int4Embedding(codes, scales, zeros, rows.shape[1], rows.dtype,
                                  embed_scale=getattr(inputs, "embed_scale", None))
        model.set_input_embeddings(table)
        del rows
    del output, weight, inputs
    return {"head": head_format(new_head), "embedding": head_format(model.get_input_embeddings()), "reason": reason}


def head_format(module: nn.Module) -> str:
    """ "int4-g32" for an int4 head or table, "int8" for an int8 one, "gguf-q6_k" for a GGUF tensor's blocks, else the
    dtype of its first tensor
    ("float32", "bfloat16")."""
    if isinstance(module, (Int4Linear, Int4Embedding)):
        return layer_format(module)
    if isinstance(module, (Int8Linear, Int8Embedding)):
        return "int8"
    if isinstance(module, (BlockLinear, BlockEmbedding)):
        return f"gguf-{module.type_name.lower()}"
    first = next(iter([*module.parameters(), *module.buffers()]), None)
    return "none" if first is None else str(first.dtype).replace("torch.", "")
