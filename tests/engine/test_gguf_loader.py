"""GGUF files loaded straight into their final form (engine.weights.gguf_loader): each tensor type against the float
model transformers' own GGUF loader builds from the same file (bit for bit for float and int4 codes on the reference
path, within the stated roundings elsewhere), without a float decoder weight ever existing, the config read from
the metadata, the tokenizer cache, and the real embedded model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_files import ARCH_KEYS, arch_gguf, tiny_gguf
from tiny_models import ARCHS
from torch import nn
from transformers import AutoModelForCausalLM

from engine.reports import GgufTensors
from engine.weights import gguf_blocks
from engine.weights.fingerprint import fingerprint
from engine.weights.gguf_file import read_gguf
from engine.weights.gguf_loader import FLOAT_TYPES, ROW_TYPES, auto_weights, meta_model
from engine.weights.head import Int4Embedding, Int8Embedding, Int8Linear
from engine.weights.int4 import Int4Linear, decoder_linears
from engine.weights.loader import (
    default_model_path,
    load_model,
    quiet_transformers,
    resolve_source,
)
from engine.weights.weights_report import weights_report

CPU = torch.device("cpu")
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
ALL_TYPES = INT4_TYPES + ROW_TYPES + FLOAT_TYPES
from cpu_kernels import needs_cpu_kernel  # noqa: E402

IDS = torch.tensor([[5, 70, 300, 12, 400, 9, 33, 200, 201, 202, 17, 18]])
# The int4pack and int8pack kernels compute in bfloat16 (activations, and the kernel's scale/offset): their
# logits on these files are 1.2-2.8% of the largest logit from the float model's (measured), bounded at 5%.
BF16_LOGIT_BOUND = 0.05

quiet_transformers()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(GGUF type, arch) -> a tiny file whose decoder linears are all of that type, made on first use."""
    folder = tmp_path_factory.mktemp("gguf")
    made: dict = {}

    def get(kind: str, arch: str = "llama", **options):
        key = (kind, arch, tuple(sorted(options.items())))
        if key not in made:
            made[key] = tiny_gguf(folder / f"{arch}-{kind}-{len(made)}.gguf", kind, arch=arch, **options)
        return made[key]

    return get


def transformers_model(path):
    """The float reference: transformers' own GGUF loader (gguf-py's dequantize, float32)."""
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                attn_implementation="sdpa").eval()


def ours(path, **options):
    return load_model(resolve_source(str(path)), CPU, torch.float32, **options)[0]


def int8_bound(layer: Int8Linear) -> torch.Tensor:
    """How far an int8 row may be from the weight it was made from: half its step (max |w| / 127), and the
    cpu_int8pack kernel holds the step in bfloat16 (2^-8 of it, times |q| <= 127: a scale of the whole row)."""
    step = layer.scales.float()[:, None]
    return step * (0.5 + 127 * 2**-8) * (1 + 2**-7)


def logits(model) -> torch.Tensor:
    with torch.inference_mode():
        return model(IDS).logits


# -- every type against transformers' loader ---------------------------------------------------------------------

@pytest.mark.parametrize("kind,arch", [(k, "llama") for k in ALL_TYPES] + [(k, "qwen2") for k in ("Q4_K", "Q6_K")])
def test_a_float_load_equals_transformers_gguf_loader_bit_for_bit(files, kind, arch, one_thread):
    path = files(kind, arch)
    reference, model = transformers_model(path), ours(path, weights="float")
    want, got = dict(reference.named_parameters()), dict(model.named_parameters())
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    assert {n: b for n, b in model.named_buffers()}.keys() == {n: b for n, b in reference.named_buffers()}.keys()
    assert all(torch.equal(b, dict(reference.named_buffers())[n]) for n, b in model.named_buffers())  # inv_freq
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: one Parameter
    assert fingerprint(model) == fingerprint(reference)  # KV written under either load is the same KV
    mix = weights_report(model).gguf
    assert mix[f"{kind}->float32"].tensors == sum(r.type_name == kind for r in read_gguf(path).tensors.values())


@pytest.mark.parametrize("kind", INT4_TYPES)
def test_4_bit_tensors_become_int4_layers_holding_the_files_codes(files, kind, one_thread):
    path = files(kind)
    reference, model = transformers_model(path), ours(path, weights="int4", kernel="reference", head="float")
    for name, layer in decoder_linears(reference):
        held = model.get_submodule(name)
        assert isinstance(held, Int4Linear) and held.origin == f"gguf-{kind.lower()}" and held.group_size == 32
        assert torch.equal(held.dequantize(torch.float32), layer.weight), name  # llama's q/k rows included
    assert torch.allclose(logits(model), logits(reference), atol=1e-5, rtol=0)
    report = weights_report(model)
    assert report.format == f"gguf-{kind.lower()}-g32" and report.kernel == "reference"
    assert report.gguf[f"{kind}->int4"].tensors == 14


needs_blocks = pytest.mark.skipif(gguf_blocks.unavailable() is not None,
                                  reason=f"block kernel unavailable: {gguf_blocks.unavailable()}")
# The block kernel rounds activations to int8 per block (as llama.cpp does): on these files its logits are 1-3% of
# the largest logit from the float model's (measured), bounded at 6%.
BLOCKS_LOGIT_BOUND = 0.06


def test_where_a_c_compiler_exists_the_kernels_build():
    """The block kernel's tests skip where it cannot be had; where a compiler is found (CI's machines), it must
    build, so those skips never hide a broken kernel."""
    import shutil

    if shutil.which("cc") or shutil.which("gcc"):
        assert gguf_blocks.unavailable() is None


@needs_blocks
@pytest.mark.parametrize("kind", tuple(gguf_blocks.BLOCK_TYPES))
def test_the_types_the_block_kernel_holds_are_kept_as_the_files_own_bytes(files, kind, one_thread):
    path = files(kind, table_type=kind)
    file = read_gguf(path)
    reference, model = transformers_model(path), ours(path, weights="int4", kernel=gguf_blocks.KERNEL)
    for name, layer in decoder_linears(reference):
        held = model.get_submodule(name)
        assert isinstance(held, gguf_blocks.BlockLinear) and held.type_name == kind, name
        assert torch.equal(held.dequantize(), layer.weight), name  # llama's q/k rows included
    head, table = model.get_output_embeddings(), model.get_input_embeddings()
    assert isinstance(head, gguf_blocks.BlockLinear) and isinstance(table, gguf_blocks.BlockEmbedding)
    assert head.blocks.data_ptr() == table.blocks.data_ptr()  # the tied table's blocks, held once
    ids = torch.arange(512)
    assert torch.equal(table(ids), reference.model.embed_tokens(ids))
    ref = logits(reference)
    assert (logits(model) - ref).abs().max() <= BLOCKS_LOGIT_BOUND * ref.abs().max()
    report = weights_report(model)
    assert report.format == f"gguf-{kind.lower()}" and report.kernel == gguf_blocks.KERNEL
    assert report.head == report.embedding == f"gguf-{kind.lower()}"
    matrices = [r for r in file.tensors.values() if r.type_name == kind]
    assert report.gguf[f"{kind}->blocks"] == GgufTensors(tensors=15, file_bytes=sum(r.nbytes for r in matrices),
                                                         bytes=sum(r.nbytes for r in matrices))
    assert report.attention == "sdpa"  # the engine switches it (engine.exact_attention): the next test


@needs_blocks
def test_an_engine_over_blocks_computes_attention_in_float64(files, one_thread):
    from engine import EngineConfig, KVBoost

    model, tokenizer = load_model(resolve_source(str(files("Q4_K"))), CPU, torch.float32, weights="int4",
                                  kernel=gguf_blocks.KERNEL)
    engine = KVBoost(model, tokenizer, EngineConfig.of(disk_cache_bytes=0))
    assert engine.info().weights.attention == "rows_exact"


@needs_blocks
def test_blocks_and_int4_codes_are_different_weights_to_the_cache(files, one_thread):
    path = files("Q4_K")
    blocks = ours(path, weights="int4", kernel=gguf_blocks.KERNEL)
    assert fingerprint(blocks) != fingerprint(ours(path, weights="int4", kernel="cpu_int4pack"))


@needs_cpu_kernel
@pytest.mark.parametrize("kind", INT4_TYPES)
def test_on_the_cpu_int4_kernel_scales_and_offsets_are_rounded_to_bf16_only(files, kind, one_thread):
    path = files(kind)
    reference, model = transformers_model(path), ours(path, weights="int4", kernel="cpu_int4pack", head="float")
    exact = ours(path, weights="int4", kernel="reference", head="float")
    for name, layer in decoder_linears(reference):
        held, codes = model.get_submodule(name), exact.get_submodule(name)
        assert held.kernel == "cpu_int4pack", name
        # The kernel holds the scale s and its offset o = (8 - zero) * s + offset in bfloat16 (2^-8 of each,
        # |q - 8| <= 8) and hands the weight back in bfloat16 (2^-8 |w|).
        s = codes.scales.abs().repeat_interleave(32, dim=1)  # a Q4_0 d may be negative
        o = (8 - codes.zeros.float()) * codes.scales + (0 if codes.offsets is None else codes.offsets)
        bound = 2**-8 * (layer.weight.abs() + 8 * s + o.repeat_interleave(32, dim=1).abs()) * (1 + 2**-7)
        assert torch.all((held.dequantize(torch.float32) - layer.weight).abs() <= bound), name
    ref = logits(reference)
    assert (logits(model) - ref).abs().max() <= BF16_LOGIT_BOUND * ref.abs().max()


@pytest.mark.parametrize("kind", ROW_TYPES)
def test_5_6_and_8_bit_tensors_become_int8_rows_of_their_dequantized_values(files, kind, one_thread):
    """Where the block kernel does not run (here: the int4pack kernel asked for)."""
    path = files(kind)
    reference, model = transformers_model(path), ours(path, weights="int4", kernel="cpu_int4pack", head="float")
    for name, layer in decoder_linears(reference):
        held = model.get_submodule(name)
        assert isinstance(held, Int8Linear) and held.kernel == "cpu_int8pack", name
        assert torch.all((held.dequantize(torch.float32) - layer.weight).abs() <= int8_bound(held)), name
    ref = logits(reference)
    assert (logits(model) - ref).abs().max() <= BF16_LOGIT_BOUND * ref.abs().max()
    report = weights_report(model)
    assert report.format == "int8" and report.kernel == "cpu_int8pack" and report.num_int4_linears == 0
    assert report.gguf[f"{kind}->int8"].tensors == 14


@pytest.mark.parametrize("kind", FLOAT_TYPES)
def test_float_tensors_are_quantized_to_int4_one_at_a_time(files, kind, one_thread):
    path = files(kind)
    reference, model = transformers_model(path), ours(path, weights="int4", kernel="reference", group_size=32)
    for name, layer in decoder_linears(reference):
        held = model.get_submodule(name)
        assert isinstance(held, Int4Linear) and held.origin == "rtn" and held.group_size == 32, name
        step = held.scales.repeat_interleave(32, dim=1)  # round-to-nearest: within half a step
        assert torch.all((held.dequantize(torch.float32) - layer.weight).abs() <= step * (0.5 + 1e-4)), name
    assert weights_report(model).gguf[f"{kind}->int4"].tensors == 14


def test_qwen2_biases_stay_float_beside_int4_codes(files, one_thread):
    path = files("Q4_0", "qwen2")
    reference, model = transformers_model(path), ours(path, weights="int4", kernel="reference", head="float")
    q_proj = model.get_submodule("model.layers.1.self_attn.q_proj")
    assert torch.equal(q_proj.bias, reference.get_submodule("model.layers.1.self_attn.q_proj").bias)
    assert torch.allclose(logits(model), logits(reference), atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["qwen3", "phi3", "gemma3"])
def test_other_architectures_load_through_the_same_names_and_transforms(tmp_path, arch, one_thread):
    # qwen3: q/k norms; phi3: fused qkv and gate/up; gemma3: norms stored as w + 1, post-norms, a scaled table
    path = arch_gguf(tmp_path / f"{arch}.gguf", arch, "Q8_0", metadata=ARCH_KEYS.get(arch))
    reference, model = transformers_model(path), ours(path, weights="float")
    want = dict(reference.named_parameters())
    assert sorted(dict(model.named_parameters())) == sorted(want)
    assert all(torch.equal(p, want[n]) for n, p in model.named_parameters())
    assert torch.equal(logits(model), logits(reference))
    ref, quantized = logits(reference), logits(ours(path, weights="int4"))
    assert (quantized - ref).abs().max() <= BF16_LOGIT_BOUND * ref.abs().max()


# -- memory: the float model is never built ----------------------------------------------------------------------

@pytest.mark.parametrize("arch", [a for a, (_, attn) in ARCHS.items() if attn == "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_meta_model_computes_the_buffers_a_file_does_not_hold_as_transformers_does(arch, dtype):
    config = ARCHS[arch][0]()
    real = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = meta_model(config, dtype)
    assert all(p.is_meta for p in model.parameters())
    want = dict(real.named_buffers())
    assert sorted(dict(model.named_buffers())) == sorted(want)  # inv_freq per rotary, Gemma's embed_scale
    for name, buffer in model.named_buffers():
        assert buffer.dtype == want[name].dtype and torch.equal(buffer, want[name]), name


def registered_float_weights(load) -> list[str]:
    """Names and shapes of the floating-point parameters and buffers of at least 64 x 256 elements (the smallest
    decoder weight here) that are registered on a real device while `load` runs."""
    seen = []

    def hook(module, name, tensor):
        if tensor is not None and not tensor.is_meta and tensor.is_floating_point() and tensor.numel() >= 64 * 256:
            seen.append(f"{type(module).__name__}.{name} {list(tensor.shape)}")

    handles = [nn.modules.module.register_module_parameter_registration_hook(hook),
               nn.modules.module.register_module_buffer_registration_hook(hook)]
    try:
        load()
    finally:
        for handle in handles:
            handle.remove()
    return seen


def test_an_int4_load_never_holds_a_float_decoder_weight(files, one_thread):
    path = files("Q4_K")
    assert registered_float_weights(lambda: ours(path, weights="int4")) == []
    floats = registered_float_weights(lambda: ours(path, weights="float"))  # the same hook sees a float load's
    assert len(floats) == 2 * 7 + 2  # the decoder linears, the table and the tied head registering it again


def test_int8_head_and_table_share_codes_made_from_the_files_table(files, one_thread):
    path = files("Q4_K", table_type="Q8_0")
    reference, model = transformers_model(path), ours(path, weights="int4", kernel="cpu_int4pack")
    head, table = model.get_output_embeddings(), model.get_input_embeddings()
    assert isinstance(head, Int8Linear) and isinstance(table, Int8Embedding)
    assert table.codes.data_ptr() == head.codes.data_ptr()  # held once
    assert torch.all((head.dequantize() - reference.lm_head.weight).abs() <= int8_bound(head))
    assert weights_report(model).gguf["Q8_0->int8"].tensors == 1


def test_an_int4_head_and_table_take_a_q4_k_tables_codes_as_they_are(files, one_thread):
    path = files("Q4_K", table_type="Q4_K")
    reference = transformers_model(path)
    model = ours(path, weights="int4", kernel="reference", head="int4+embedding")
    head, table = model.get_output_embeddings(), model.get_input_embeddings()
    assert isinstance(head, Int4Linear) and head.origin == "gguf-q4_k" and isinstance(table, Int4Embedding)
    assert torch.equal(head.dequantize(torch.float32), reference.lm_head.weight)
    ids = torch.arange(512)
    assert torch.equal(table(ids), reference.model.embed_tokens(ids))  # offsets included


def test_an_untied_head_is_read_from_its_own_tensor(files, one_thread):
    path = files("Q4_0", tied=False, table_type="Q6_K")
    reference, model = transformers_model(path), ours(path, weights="float")
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, reference.lm_head.weight)
    assert torch.equal(logits(model), logits(reference))
    quantized = ours(path, weights="int4", kernel="cpu_int4pack")
    assert weights_report(quantized).gguf["Q6_K->int8"].tensors == 2  # head and table, each its own rows
    if gguf_blocks.unavailable() is None:  # head and table each their own tensor's blocks, under block layers
        blocks = ours(path, weights="int4", kernel=gguf_blocks.KERNEL)
        assert weights_report(blocks).gguf["Q6_K->blocks"].tensors == 2
        assert blocks.lm_head.blocks.data_ptr() != blocks.model.embed_tokens.blocks.data_ptr()
        assert torch.equal(blocks.lm_head.dequantize(), reference.lm_head.weight)
        ids = torch.arange(512)
        assert torch.equal(blocks.model.embed_tokens(ids), reference.model.embed_tokens(ids))


def test_the_report_counts_tensors_and_bytes_per_type_and_form(files, one_thread):
    path = files("Q4_K", table_type="Q8_0")
    file = read_gguf(path)
    mix = weights_report(ours(path, weights="int4", kernel="reference")).gguf
    assert {k: v.tensors for k, v in mix.items()} == {"F32->float32": 5, "Q4_K->int4": 14, "Q8_0->int8": 1}
    q4 = [r for r in file.tensors.values() if r.type_name == "Q4_K"]
    assert mix["Q4_K->int4"].file_bytes == sum(r.nbytes for r in q4)
    # reference layout: half a byte a weight, a float32 scale, a byte zero and a float32 offset per 32
    assert mix["Q4_K->int4"].bytes == sum(r.num_elements // 2 + r.num_elements // 32 * 9 for r in q4)


def test_auto_weights_say_int4_for_a_4_bit_file_and_float_otherwise(files):
    assert auto_weights(read_gguf(files("Q4_K"))) == "int4"
    assert auto_weights(read_gguf(files("Q8_0"))) == "float"
    assert auto_weights(read_gguf(default_model_path())) == "int4"


# -- config and tokenizer ----------------------------------------------------------------------------------------

# -- the real model ----------------------------------------------------------------------------------------------

def test_the_real_models_float_load_equals_transformers_own_gguf_loader(smollm_float):
    path = default_model_path()
    reference = transformers_model(path)
    model = smollm_float.model  # loaded with weights="float" through engine.weights.gguf_loader
    assert set(weights_report(model).gguf) == {"F32->float32", "Q4_1->float32", "Q8_0->float32"}
    want = dict(reference.named_parameters())
    assert sorted(dict(model.named_parameters())) == sorted(want)
    assert all(torch.equal(p, want[n]) for n, p in model.named_parameters())
    assert fingerprint(model) == fingerprint(reference)


def test_the_real_model_loads_its_q4_1_blocks_as_int4_and_answers(smollm_float, one_thread):
    model, tokenizer = load_model(resolve_source(None), CPU, torch.float32, weights="int4", kernel="reference")
    mix = weights_report(model).gguf
    assert {k: v.tensors for k, v in mix.items()} == {"F32->float32": 61, "Q4_1->int4": 210, "Q8_0->int8": 1}
    for name, layer in decoder_linears(smollm_float.model)[:14]:  # two decoder layers: every projection, q/k permuted
        assert torch.equal(model.get_submodule(name).dequantize(torch.float32), layer.weight), name
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids["input_ids"].shape[1]:])
    assert np.isfinite(logits(model).numpy()).all()


def test_a_load_reports_each_decoder_layer_as_it_is_filled(files, one_thread):
    """Progress for the app's load dialog: the tokenizer, then one step per decoder layer in order, then the
    head and table; an exception from the callback (a cancel) stops the load there."""
    path = files("Q4_K")
    steps = []
    model = load_model(resolve_source(str(path)), CPU, torch.float32, weights="int4",
                       progress=lambda done, total, what: steps.append((done, total, what)))[0]
    layers = model.config.num_hidden_layers
    assert steps[0] == (0, 0, "tokenizer")
    counted = [s for s in steps if s[1]]
    assert [s[0] for s in counted] == list(range(1, layers + 2))
    assert all(s[1] == layers + 1 for s in counted)
    assert counted[0][2] == f"layer 1 of {layers}"

    class Stop(Exception):
        pass

    def stop_after_first_layer(done, total, what):
        if done == 1:
            raise Stop

    with pytest.raises(Stop):
        load_model(resolve_source(str(path)), CPU, torch.float32, weights="int4", progress=stop_after_first_layer)


@pytest.mark.parametrize("kind", ["Q6_K", "Q4_K", "F16"])
def test_a_tensor_converted_a_few_rows_at_a_time_holds_what_one_pass_makes(files, kind, monkeypatch, one_thread):
    """Large tensors are dequantized CHUNK_ELEMENTS values at a time and packed for the CPU int4 kernel PACK_ROWS
    rows at a time (bounded memory at 7B); slices of 3 rows / 64-row tiles must give every buffer of one pass."""
    import engine.weights.gguf_tensors as gguf_tensors
    import engine.weights.int4 as int4

    path = files(kind)
    whole = ours(path, weights="int4", head="int8+embedding", group_size=32)
    monkeypatch.setattr(gguf_tensors, "CHUNK_ELEMENTS", 3 * 256)  # 3 rows of a 256-wide matrix
    monkeypatch.setattr(int4, "PACK_ROWS", 64)
    sliced = ours(path, weights="int4", head="int8+embedding", group_size=32)
    want = dict(whole.named_buffers())
    got = dict(sliced.named_buffers())
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[n], want[n]) for n in want), [n for n in want if not torch.equal(got[n], want[n])]
    assert any(isinstance(m, (Int4Linear, Int8Linear)) for m in sliced.modules())


@pytest.mark.parametrize("kind", ["Q6_K", "Q8_0"])
def test_the_torch_dequantizers_give_gguf_pys_values_bit_for_bit(kind):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from engine.weights.gguf_tensors import dequantize_q6_k, dequantize_q8_0

    rng = np.random.default_rng(5)
    weight = (rng.standard_normal((48, 512)) * rng.uniform(0.01, 3, (48, 1))).astype(np.float32)
    weight[3] = 0  # an all-zero row: scales of zero
    weight[7, :40] = 65000.0  # near fp16's largest scale
    if kind == "Q6_K":
        from gguf_files import quantize_q6_k, random_blocks

        data = np.concatenate([quantize_q6_k(weight).reshape(48, -1), random_blocks("Q6_K", 16, 512, rng)])
        ours = dequantize_q6_k(data)
    else:
        data = quantize(weight, GGMLQuantizationType.Q8_0)
        ours = dequantize_q8_0(data)
    want = dequantize(data, GGMLQuantizationType[kind])
    assert ours.dtype == torch.float32 and ours.shape == want.shape
    assert torch.equal(ours, torch.from_numpy(np.array(want)))


@pytest.mark.parametrize(("kind", "weights", "kernel"), [
    ("Q4_K", "int4", "auto"), ("Q4_0", "int4", "auto"), ("Q6_K", "int4", "auto"), ("Q8_0", "int4", "auto"),
    ("Q4_K", "int4", "gguf_blocks"), ("Q4_1", "int4", "gguf_blocks"), ("Q6_K", "int4", "cpu_int4pack"),
    ("Q8_0", "float", "auto"), ("F16", "int4", "auto")])
def test_reuse_over_every_weight_form_gives_the_uncached_greedy_tokens(files, kind, weights, kernel, one_thread):
    """EXACT and PREFIX hits over the file's blocks (Q6_K / Q8_0 with kernel "auto" where the block kernel runs,
    every type with "gguf_blocks"), int4 codes and int8 rows (the int4pack kernels), RTN int4 and float: 12 prompts
    sharing prefixes of whole chunks, each
    answered after the others filled the cache: the first token's logits (bit for bit over the quantized forms;
    under float32 attention Q4_0's moved) and the greedy tokens those of an uncached run. Divergences: none of 24."""
    from engine import EngineConfig, KVBoost

    if kernel == gguf_blocks.KERNEL and gguf_blocks.unavailable() is not None:
        pytest.skip(f"block kernel unavailable: {gguf_blocks.unavailable()}")
    model, tokenizer = load_model(resolve_source(str(files(kind))), CPU, torch.float32, weights=weights,
                                  kernel=kernel)
    cached = KVBoost(model, tokenizer, EngineConfig.of(chunk_size=16, disk_cache_bytes=0))
    plain = cached.with_options(reuse="off")
    rng = np.random.default_rng(11)
    shared = [rng.integers(3, 500, size=16 * n).tolist() for n in (1, 2, 3)]
    prompts = [shared[i % 3] + rng.integers(3, 500, size=int(rng.integers(1, 40))).tolist() for i in range(12)]
    diverged, moved, hits = 0, 0, set()
    for ids in prompts + prompts:  # the second pass: EXACT hits of whole prompts
        got = cached.generate(ids, max_new_tokens=12, return_logits=True)
        want = plain.generate(ids, max_new_tokens=12, return_logits=True)
        hits |= {kind for _, _, kind in got.stats.chunks}
        diverged += got.token_ids != want.token_ids
        if weights == "float":  # float32 kernels: attention's shape moves the logits by ~1e-6, as documented
            moved += (got.first_logits - want.first_logits).abs().max().item() > 1e-4
        else:
            moved += not torch.equal(got.first_logits, want.first_logits)
    assert hits >= {"EXACT"} and diverged == 0 and moved == 0
