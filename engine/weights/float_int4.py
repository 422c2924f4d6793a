"""A float safetensors folder (fp16 / bf16 / fp32) loaded as int4, each tensor quantized as it is read: the float
model is never built.

The architecture is built from its config on the meta device (engine.weights.gguf_loader.meta_model: no parameter
memory; RoPE's inv_freq and the like computed on the host). Every tensor's dtype and shape are checked against the
parameter it fills from the files' headers before anything is read: a missing tensor, one no parameter or buffer
takes, a shape the config does not make, or a dtype other than F16 / BF16 / F32 is a CheckpointError naming it.
Then, one tensor at a time:
- a decoder layer's linear weight (engine.weights.int4.decoder_linears) is cast to the load's `dtype` (as the float
  model would hold it), moved to `device` and quantized there by engine.weights.int4.quantize_rtn at `group_size`, its
  bias in `dtype`; the Int4Linear is what engine.weights.int4.quantize_model makes of the float model's layer, buffer
  for buffer (the same kernel choice, the same reference fallback for shapes the kernel cannot take);
- every other tensor (embeddings, norms, the output head) is cast to `dtype` on `device`; a tied head shares the
  table's Parameter (a tied head's own tensor, where a file holds one, is not read).
Names are the model's own (`model.layers.0.mlp.up_proj.weight`); a file saved from the bare decoder, whose keys
lack the model's `base_model_prefix` (`layers.0.mlp.up_proj.weight`), is read under the prefixed names.

The folder reading here (SafetensorsFolder, model_names, check_tensors, read_float, set_tensor) is shared with
engine.weights.gptq, whose checkpoints hold their norms, embeddings and head as float tensors.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from .awq import _layer_index, _Tensors
from .gguf_loader import Progress, meta_model, release_freed_memory
from .int4 import (
    Int4Linear,
    check_group_size,
    decoder_linears,
    padded_features,
    pick_kernel,
    quantize_rtn,
    replace_module,
    shape_problem,
)

log = logging.getLogger(__name__)

FLOAT_DTYPES = ("F16", "BF16", "F32")  # safetensors' names of the float dtypes read here


class CheckpointError(ValueError):
    """A safetensors folder that disagrees with its config: a missing, extra, mis-shaped or non-float tensor."""


class SafetensorsFolder(_Tensors):
    """engine.weights.awq's lazy reader (every tensor of the folder's *.safetensors by name, nothing read until asked),
    with each tensor's dtype and shape read from the file's header."""

    def __init__(self, folder: Path, error: type[ValueError] = CheckpointError):
        if not any(Path(folder).glob("*.safetensors")):
            raise error(f"{folder} holds no .safetensors files")
        super().__init__(folder)

    def header(self, key: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype name such as "F16" or "I32", shape) of a tensor, from the header alone."""
        view = self._files[self._where[key]].get_slice(key)
        return view.get_dtype(), tuple(int(n) for n in view.get_shape())


def model_names(tensors: SafetensorsFolder, model, error: type[ValueError] = CheckpointError) -> dict[str, str]:
    """{the model's name for a tensor: its key in the files}, for every tensor of the folder. A key whose module
    is not the model's but is under the model's `base_model_prefix` (a checkpoint of the bare decoder) takes the
    prefix; two keys naming one tensor are an error."""
    modules = {name for name, _ in model.named_modules()}
    prefix = getattr(model, "base_model_prefix", "") or ""
    names: dict[str, str] = {}
    for key in tensors.keys():
        module, _, leaf = key.rpartition(".")
        if module not in modules and prefix and f"{prefix}.{module}".rstrip(".") in modules:
            module = f"{prefix}.{module}".rstrip(".")
        name = f"{module}.{leaf}" if module else leaf
        if name in names:
            raise error(f"tensors {names[name]!r} and {key!r} are both {name}")
        names[name] = key
    return names


def float_parameters(model) -> dict[str, nn.Parameter]:
    """The parameters a checkpoint fills, each once (a tied head's under the table's name)."""
    return dict(model.named_parameters())


def _listed(items: list[str]) -> str:
    return ", ".join(items[:6]) + (f" and {len(items) - 6} more" if len(items) > 6 else "")


def check_tensors(tensors: SafetensorsFolder, names: dict[str, str], expected: dict[str, tuple[tuple, tuple]],
                  model, error: type[ValueError] = CheckpointError) -> None:
    """Every tensor `expected` ({model name: (shape, allowed dtype names)}) is in the files with its shape and a
    dtype allowed, and the files hold nothing else but tensors of the model's buffers (which the model computes
    itself, so they are not read) and a tied head's own copy. From the headers alone: nothing is read."""
    missing = [name for name in expected if name not in names]
    if missing:
        raise error(f"the checkpoint lacks {len(missing)} tensor(s) the config needs: {_listed(missing)}")
    skipped = {name for name, _ in model.named_buffers()}
    skipped |= set(dict(model.named_parameters(remove_duplicate=False))) - set(dict(model.named_parameters()))
    extra = sorted(names[name] for name in names if name not in expected and name not in skipped)
    if extra:
        raise error(f"the checkpoint holds {len(extra)} tensor(s) the config has no place for: {_listed(extra)}")
    for name, (shape, dtypes) in expected.items():
        kind, stored = tensors.header(names[name])
        if kind not in dtypes:
            raise error(f"tensor {names[name]!r} is {kind}, expected {' or '.join(dtypes)}")
        if stored != tuple(shape):
            raise error(f"tensor {names[name]!r} has shape {list(stored)}, but the config makes {name} {list(shape)}")


def read_float(tensors: SafetensorsFolder, key: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A checked float tensor in `dtype` on `device` (read, cast, moved: one tensor's transients at a time)."""
    return tensors.get(key).to(dtype).to(device)


def set_tensor(model, name: str, value: torch.Tensor) -> nn.Parameter:
    parameter = nn.Parameter(value, requires_grad=False)
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, parameter)
    return parameter


def fill_floats(model, tensors: SafetensorsFolder, names: dict[str, str], dtype: torch.dtype,
                device: torch.device) -> None:
    """Every parameter still on meta from its (checked) tensor in `dtype` on `device`; a head tied to the table
    shares the table's new Parameter."""
    head, table = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and table is not None and head.weight is table.weight
    for name, parameter in float_parameters(model).items():
        if parameter.is_meta:
            set_tensor(model, name, read_float(tensors, names[name], dtype, device))
    if tied:
        head.weight = table.weight


def layer_ends(linear_names: list[str]) -> dict[int, int]:
    """{position in `linear_names` of a decoder layer's last linear: how many layers are done after it}."""
    ends: dict[int, int] = {}
    for position, name in enumerate(linear_names):
        here = _layer_index(name)
        after = _layer_index(linear_names[position + 1]) if position + 1 < len(linear_names) else None
        if here is not None and after != here:
            ends[position] = len(ends) + 1
    return ends


def report_layers(progress: Progress | None, linear_names: list[str]) -> tuple[Callable[[int], None], int]:
    """(a callback for "the linear at this position is in place", the number of steps: layers + 1): it calls
    progress(done, layers + 1, "layer i of n") after each decoder layer's last linear; the last step is the
    head, table and norms."""
    ends = layer_ends(linear_names)
    total = len(ends) + 1

    def done(position: int) -> None:
        if progress is not None and position in ends:
            progress(ends[position], total, f"layer {ends[position]} of {len(ends)}")

    return done, total


def load_float_as_int4(folder: Path, config, device: torch.device, dtype: torch.dtype, *, group_size: int = 128,
                       kernel: str = "auto", progress: Progress | None = None):
    """The float safetensors model in `folder` (whose transformers config is `config`) in eval mode on `device`:
    its decoder linears Int4Linear (round-to-nearest at `group_size`, on `kernel`: "auto" or one of
    engine.weights.int4.KERNELS), everything else in `dtype` (the module docstring). `progress(done, total, what)` after
    each decoder layer and once when the rest is in place."""
    check_group_size(group_size)
    tensors = SafetensorsFolder(folder)
    model = meta_model(config, dtype)
    names = model_names(tensors, model)
    check_tensors(tensors, names, {name: (tuple(p.shape), FLOAT_DTYPES) for name, p in float_parameters(model).items()},
                  model)
    path, reason = pick_kernel(kernel, device)
    if reason:
        log.info("int4 on %s: reference path (%s)", device, reason)
    linears = decoder_linears(model)
    if not linears:
        raise CheckpointError(f"no nn.Linear inside decoder layers of {type(model).__name__}: nothing to quantize")
    layer_done, total = report_layers(progress, [name for name, _ in linears])
    for position, (name, linear) in enumerate(linears):
        replace_module(model, name, _int4_layer(tensors, names, name, linear, group_size, path, reason, device, dtype))
        layer_done(position)
    fill_floats(model, tensors, names, dtype, device)
    model.to(device)  # the buffers computed on the host (inv_freq); every parameter is there already
    model.eval()
    release_freed_memory()
    if progress is not None:
        progress(total, total, "output head, embeddings and norms")
    return model


def _int4_layer(tensors: SafetensorsFolder, names: dict[str, str], name: str, linear: nn.Linear, group_size: int,
                kernel: str, reason: str | None, device: torch.device, dtype: torch.dtype) -> Int4Linear:
    """One decoder linear as engine.weights.int4.quantize_model makes it from the float model's layer in `dtype`."""
    weight = read_float(tensors, names[f"{name}.weight"], dtype, device)  # [out, in], as the float model holds it
    bias = read_float(tensors, names[f"{name}.bias"], dtype, device) if linear.bias is not None else None
    problem = shape_problem(kernel, linear.out_features, padded_features(linear.in_features, group_size))
    if problem is not None:
        log.info("int4 %s: reference path (%s)", name, problem)
        kernel, reason = "reference", problem
    codes, scales, zeros = quantize_rtn(weight, group_size)
    del weight
    layer = Int4Linear.from_codes(codes, scales, zeros, linear.in_features, bias, kernel)
    layer.fallback_reason = reason
    return layer
