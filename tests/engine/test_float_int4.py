"""Float safetensors folders quantized to int4 as they are read (engine.weights.float_int4): the same layers, buffer for
buffer, as engine.weights.int4.quantize_model makes of the float model transformers loads; no float decoder weight ever
registered; names without the model's prefix; missing, extra, mis-shaped and non-float tensors named in errors."""

from __future__ import annotations

import pytest
import torch
from cpu_kernels import needs_cpu_kernel
from safetensors.torch import load_file, save_file
from tiny_models import ARCHS, build_model, random_ids
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from engine.weights.float_int4 import CheckpointError, load_float_as_int4
from engine.weights.int4 import Int4Linear, quantize_model

CPU = torch.device("cpu")
GROUP = 32
DECODER_WEIGHT = 32 * 64  # elements of the smallest decoder weight here (k_proj, v_proj: [32, 64])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(arch, file dtype) -> a save_pretrained folder of tiny_models' random model (llama and qwen3 tie their
    head; qwen2 has biases and its own head)."""
    root = tmp_path_factory.mktemp("float")
    made = {}

    def get(arch: str, dtype: torch.dtype):
        if (arch, dtype) not in made:
            model = build_model(arch)
            if arch == "qwen2":  # an untied head: its own tensor in the file
                model.config.tie_word_embeddings = False
                model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
            else:
                model.config.tie_word_embeddings = True
                model.tie_weights()
                assert model.lm_head.weight is model.model.embed_tokens.weight
            folder = root / f"{arch}-{str(dtype).removeprefix('torch.')}"
            model.to(dtype).save_pretrained(str(folder))
            made[arch, dtype] = folder
        return made[arch, dtype]

    return get


def ours(folder, dtype=torch.float32, **options):
    return load_float_as_int4(folder, AutoConfig.from_pretrained(str(folder)), CPU, dtype,
                              **{"group_size": GROUP, **options})


def quantized_float_model(folder, dtype=torch.float32, kernel="reference"):
    """What weights="int4" made before: transformers' float model, then engine.weights.int4.quantize_model."""
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, attn_implementation="sdpa").eval()
    quantize_model(model, group_size=GROUP, kernel=kernel)
    return model


def assert_same_model(got, want):
    got_state, want_state = got.state_dict(), want.state_dict()
    assert sorted(got_state) == sorted(want_state)
    for name, value in want_state.items():
        assert got_state[name].dtype == value.dtype and torch.equal(got_state[name], value), name
    assert {n: type(m) for n, m in got.named_modules()} == {n: type(m) for n, m in want.named_modules()}
    assert {n: (m.kernel, m.fallback_reason) for n, m in got.named_modules() if isinstance(m, Int4Linear)} == \
        {n: (m.kernel, m.fallback_reason) for n, m in want.named_modules() if isinstance(m, Int4Linear)}


def logits_of(model, ids):
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("arch,file_dtype,dtype", [
    ("llama", torch.float16, torch.float32), ("llama", torch.float32, torch.float32),
    ("qwen2", torch.float32, torch.bfloat16), ("qwen3", torch.float16, torch.float16)])
def test_a_load_equals_quantize_model_on_the_float_model_bit_for_bit(folders, arch, file_dtype, dtype, one_thread):
    folder = folders(arch, file_dtype)
    got, want = ours(folder, dtype, kernel="reference"), quantized_float_model(folder, dtype)
    assert_same_model(got, want)
    assert sum(isinstance(m, Int4Linear) for m in got.modules()) == 14
    head, table = got.get_output_embeddings(), got.get_input_embeddings()
    assert (head.weight is table.weight) == (arch != "qwen2")
    ids = random_ids(24, seed=3)
    assert torch.equal(logits_of(got, ids), logits_of(want, ids))


@needs_cpu_kernel
def test_on_the_cpu_int4_kernel_the_layers_are_quantize_models_too(folders, one_thread):
    folder = folders("qwen2", torch.float16)
    got, want = ours(folder), quantized_float_model(folder, kernel="auto")
    assert {m.kernel for m in got.modules() if isinstance(m, Int4Linear)} == {"cpu_int4pack"}
    assert_same_model(got, want)


def registered_float_weights(load) -> list[str]:
    """Names and shapes of the floating-point parameters and buffers of at least a decoder weight's elements that
    are registered on a real device while `load` runs."""
    seen = []

    def hook(module, name, tensor):
        if (tensor is not None and not tensor.is_meta and tensor.is_floating_point()
                and tensor.numel() >= DECODER_WEIGHT):
            seen.append(f"{type(module).__name__}.{name} {list(tensor.shape)}")

    handles = [nn.modules.module.register_module_parameter_registration_hook(hook),
               nn.modules.module.register_module_buffer_registration_hook(hook)]
    try:
        load()
    finally:
        for handle in handles:
            handle.remove()
    return seen


def test_a_load_never_holds_a_float_decoder_weight(folders, one_thread):
    folder = folders("qwen2", torch.float32)
    # Only the table and the head, each [vocab, hidden], are float tensors that large.
    assert registered_float_weights(lambda: ours(folder)) == ["Embedding.weight [512, 64]", "Linear.weight [512, 64]"]
    # The hook sees a float decoder weight where one is registered: transformers' float model built for real.
    config = AutoConfig.from_pretrained(str(folder))
    floats = registered_float_weights(lambda: AutoModelForCausalLM.from_config(config))
    assert "Linear.weight [32, 64]" in floats and len(floats) == 2 * 7 + 2


def test_progress_is_reported_after_each_decoder_layer(folders):
    steps = []
    ours(folders("llama", torch.float16), progress=lambda *step: steps.append(step))
    assert steps == [(1, 3, "layer 1 of 2"), (2, 3, "layer 2 of 2"), (3, 3, "output head, embeddings and norms")]


def test_a_bare_decoders_names_load_under_the_models_prefix(folders, tmp_path, one_thread):
    source = folders("llama", torch.float16)
    state = load_file(str(source / "model.safetensors"))
    (tmp_path / "bare").mkdir()
    save_file({k.removeprefix("model."): v for k, v in state.items()}, str(tmp_path / "bare" / "model.safetensors"))
    (tmp_path / "bare" / "config.json").write_bytes((source / "config.json").read_bytes())
    assert_same_model(ours(tmp_path / "bare", kernel="reference"), ours(source, kernel="reference"))


def changed_folder(source, dest, change):
    state = load_file(str(source / "model.safetensors"))
    change(state)
    dest.mkdir()
    save_file(state, str(dest / "model.safetensors"))
    (dest / "config.json").write_bytes((source / "config.json").read_bytes())
    return dest


UP = "model.layers.1.mlp.up_proj.weight"


@pytest.mark.parametrize("change,message", [
    (lambda s: s.pop(UP), rf"lacks 1 tensor.*{UP}"),
    (lambda s: s.__setitem__(UP, s[UP][:, :32].contiguous()), rf"{UP}.*shape \[128, 32\].*\[128, 64\]"),
    (lambda s: s.__setitem__(UP, s[UP].to(torch.int8)), rf"{UP}.*I8"),
    (lambda s: s.__setitem__("model.layers.0.mlp.scale", torch.ones(3)), "no place for.*model.layers.0.mlp.scale"),
    (lambda s: s.__setitem__(UP.removeprefix("model."), s[UP].clone()), "both"),
])
def test_tensors_that_disagree_with_the_config_are_errors_naming_them(folders, tmp_path, change, message):
    folder = changed_folder(folders("llama", torch.float16), tmp_path / "changed", change)
    with pytest.raises(CheckpointError, match=message):
        ours(folder)


def test_a_folder_without_safetensors_is_a_clear_error(folders, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_bytes((folders("llama", torch.float16) / "config.json").read_bytes())
    with pytest.raises(CheckpointError, match="no .safetensors"):
        ours(tmp_path / "empty")


def test_only_the_kernels_group_sizes_are_taken(folders):
    with pytest.raises(ValueError, match="group_size"):
        ours(folders("llama", torch.float16), group_size=48)


def test_the_config_used_is_the_one_given(folders):
    """A config whose shapes are not the folder's is refused tensor by tensor, before anything is read."""
    folder = folders("llama", torch.float16)
    config = AutoConfig.from_pretrained(str(folder))
    config.intermediate_size = 96
    with pytest.raises(CheckpointError, match="gate_proj.weight.*shape"):
        load_float_as_int4(folder, config, CPU, torch.float32, group_size=GROUP)
    assert ARCHS["llama"][0]().intermediate_size == 128
