"""Int4 weights: RTN error bounds, the reference path against float matmuls, the int4pack kernels within their
bfloat16 rounding, AWQ checkpoints read by our own loader, the weights report and fingerprint, and the real
model at int4 serving an EXACT hit equal to its full prefill."""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from awq_checkpoints import PACK_ORDER, pack_awq, write_awq_checkpoint
from tiny_models import FIRST_WORD, VOCAB, build_model, build_tokenizer, random_ids
from torch import nn

from engine import KVBoost
from engine.config import EngineConfig
from engine.exact_attention import EXACT
from engine.weights.awq import unpack_awq
from engine.weights.fingerprint import fingerprint
from engine.weights.int4 import Int4Linear, dequantize_codes, kernel_unavailable, quantize_model, quantize_rtn
from engine.weights.loader import load_model, resolve_source
from engine.weights.weights_report import weights_report

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[2]
from cpu_kernels import CPU_FAST, needs_cpu_kernel  # noqa: E402


def bf16_bound(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, group_size: int, y: torch.Tensor):
    """How far the int4pack kernels may be from the exact product x @ weight.T, element by element.

    They round x to bfloat16 (relative 2^-9), hold scale and offset = (8 - zero) * scale in bfloat16 (each off by
    2^-9 of itself; |q - 8| <= 8 and |offset| <= 8 * scale, so w is off by at most 2^-9 * 16 * scale), dequantize
    w in bfloat16 (2^-9 |w|) and round the output to bfloat16 (2^-9 |y|); products accumulate in float32. Summed:
    |err| <= 2^-8 * sum_k |x_k| (|w_k| + 8 * scale_k) + 2^-9 |y|.
    """
    s = scales.repeat_interleave(group_size, dim=1)[:, :weight.shape[1]]
    return 2**-8 * (x.abs() @ (weight.abs() + 8 * s).t()) + 2**-9 * y.abs()


# -- RTN and the reference path ----------------------------------------------------------------------------------

@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("in_features", [256, 576])  # 576 = 4.5 groups of 128: the last group is padded
def test_rtn_error_is_at_most_half_a_scale_per_element(group_size, in_features):
    g = torch.Generator().manual_seed(group_size + in_features)
    weight = torch.randn(48, in_features, generator=g) * 0.05
    weight[0] = weight[0].abs() + 0.3  # a row of only positive weights
    weight[1] = 0.0  # and one of zeros
    codes, scales, zeros = quantize_rtn(weight, group_size)
    assert codes.shape[1] % group_size == 0 and int(codes.max()) <= 15 and int(zeros.max()) <= 15
    back = dequantize_codes(codes, scales, zeros, in_features)
    half_scale = scales.repeat_interleave(group_size, dim=1)[:, :in_features] / 2
    assert torch.all((back - weight).abs() <= half_scale * (1 + 1e-5) + 1e-8)
    assert torch.equal(back[1], torch.zeros(in_features))
    # padded columns carry the zero's code, so they dequantize to exactly 0
    full = dequantize_codes(codes, scales, zeros, codes.shape[1])
    assert torch.equal(full[:, in_features:], torch.zeros(48, codes.shape[1] - in_features))


def test_reference_path_equals_a_float_matmul_of_the_dequantized_weight():
    g = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(96, 576, generator=g) * 0.05, torch.randn(96, generator=g)
    layer = Int4Linear.from_float(weight, bias, 128, "reference")
    x = torch.randn(2, 7, 576, generator=g)
    codes, scales, zeros = quantize_rtn(weight, 128)
    expected = nn.functional.linear(x, dequantize_codes(codes, scales, zeros, 576), bias)
    assert torch.allclose(layer(x), expected, atol=1e-5, rtol=0)
    assert layer(x).shape == (2, 7, 96)


@needs_cpu_kernel
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_int4pack_matches_the_reference_within_bf16_rounding(group_size, dtype):
    g = torch.Generator().manual_seed(group_size)
    weight, bias = torch.randn(192, 576, generator=g) * 0.05, torch.randn(192, generator=g) * 0.1
    reference = Int4Linear.from_float(weight, bias, group_size, "reference")
    fast = Int4Linear.from_float(weight, bias, group_size, "cpu_int4pack")
    x = torch.randn(5, 576, generator=g).to(dtype)
    exact = reference(x.float())
    got = fast(x)
    assert got.dtype == dtype
    codes, scales, zeros = quantize_rtn(weight, group_size)
    bound = bf16_bound(x.float(), reference.dequantize(torch.float32), scales, group_size, exact)
    if dtype == torch.bfloat16:  # and the result, held in bfloat16 by the caller's dtype
        bound = bound + 2**-9 * exact.abs()
    assert torch.all((got.float() - exact).abs() <= bound)
    assert (got.float() - exact).abs().max() > 0  # it did compute in bfloat16: the test can tell the paths apart
    # the kernel's own dequantized weight (read back through it) is the reference weight up to the same roundings
    w = reference.dequantize(torch.float32)
    s = scales.repeat_interleave(group_size, dim=1)[:, :576]
    assert torch.all((fast.dequantize(torch.float32) - w).abs() <= 2**-8 * (w.abs() + 8 * s))


def test_an_unknown_group_size_or_kernel_is_refused():
    with pytest.raises(ValueError, match="group_size"):
        quantize_rtn(torch.zeros(16, 96), 48)
    with pytest.raises(ValueError, match="kernel"):
        quantize_model(build_model("llama"), group_size=32, kernel="int4_magic")
    with pytest.raises(ValueError, match="tinygemm"):
        quantize_model(build_model("llama"), group_size=32, kernel="tinygemm")  # on the CPU


@pytest.mark.parametrize("kernel", ["reference", pytest.param("cpu_int4pack", marks=needs_cpu_kernel)])
def test_quantize_model_replaces_every_decoder_linear_and_keeps_embeddings_and_head(kernel, one_thread):
    model = build_model("qwen2")  # q/k/v carry biases
    original = copy.deepcopy(model)
    report = quantize_model(model, group_size=32, kernel=kernel)
    int4 = {name: m for name, m in model.named_modules() if isinstance(m, Int4Linear)}
    assert report["num_linears"] == len(int4) == 2 * 7 and report["kernels"] == {kernel: 14}
    assert not any(isinstance(m, nn.Linear) and ".layers." in f".{n}" for n, m in model.named_modules())
    assert isinstance(model.get_output_embeddings(), nn.Linear)
    assert int4["model.layers.0.self_attn.q_proj"].bias is not None
    # the float model with every decoder weight replaced by its dequantized int4 weight is the reference
    for name, layer in int4.items():
        target = original.get_submodule(name)
        codes, scales, zeros = quantize_rtn(target.weight, 32)
        with torch.no_grad():
            target.weight.copy_(dequantize_codes(codes, scales, zeros, target.in_features))
    ids = torch.tensor([random_ids(40, seed=3)])
    with torch.inference_mode():
        got, want = model(ids).logits, original(ids).logits
    tolerance = 1e-5 if kernel == "reference" else 0.05 * float(want.abs().max())  # two layers of bf16 rounding
    assert (got - want).abs().max() <= tolerance
    assert report["int4_bytes"] < report["float_bytes"] / 4


# -- AWQ checkpoints ---------------------------------------------------------------------------------------------

def test_the_packer_writes_autoawq_nibble_order():
    word = pack_awq(torch.arange(8)[None])
    assert word.dtype == torch.int32 and int(word[0, 0]) == 0x75316420
    assert int(pack_awq(torch.full((1, 8), 15))[0, 0]) == -1  # 0xFFFFFFFF, two's complement
    assert PACK_ORDER == (0, 2, 4, 6, 1, 3, 5, 7)


def test_the_engine_unpacks_what_the_packer_wrote():
    codes = torch.randint(0, 16, (24, 64), generator=torch.Generator().manual_seed(5))
    assert torch.equal(unpack_awq(pack_awq(codes)).long(), codes)
    assert unpack_awq(torch.tensor([[0x75316420]], dtype=torch.int32)).tolist() == [list(range(8))]


@pytest.fixture(scope="module")
def awq_folders(tmp_path_factory):
    """Tiny AWQ checkpoints: llama with one layer left float (modules_to_not_convert), qwen2 (biases), qwen3
    with tied embeddings. {arch: (folder, {linear: float64 weight})}"""
    root = tmp_path_factory.mktemp("awq")
    specs = {"llama": dict(not_converted=("layers.1.mlp.down_proj",)), "qwen2": {}, "qwen3": dict(tie=True)}
    return {arch: (root / arch, write_awq_checkpoint(root / arch, arch, 32, **kw)) for arch, kw in specs.items()}


def load(folder, **options):
    """The model in `folder`, its output head and table as they are stored (head="float"): these tests compare
    decoder layers; the head formats are tests/engine/test_head.py's."""
    model, _ = load_model(resolve_source(str(folder)), CPU, torch.float32, **{"head": "float", **options})
    return model


def logits_of(model, ids):
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_awq_checkpoints_load_without_an_awq_package_and_match_the_dequantized_model(awq_folders, arch, one_thread):
    assert importlib.util.find_spec("awq") is None and importlib.util.find_spec("gptqmodel") is None
    folder, expected = awq_folders[arch]
    reference = load(folder, weights="int4", kernel="reference")
    dense = load(folder, weights="float")
    for name, weight in expected.items():
        assert torch.allclose(reference.get_submodule(name).dequantize(torch.float64), weight, atol=1e-6, rtol=0)
        assert torch.allclose(dense.get_submodule(name).weight.double(), weight, atol=1e-6, rtol=0)
    assert len(expected) == sum(isinstance(m, Int4Linear) for m in reference.modules())
    ids = random_ids(48, seed=11)
    want = logits_of(dense, ids)
    assert (logits_of(reference, ids) - want).abs().max() <= 1e-5
    if CPU_FAST is None:
        fast = load(folder, weights="int4")
        assert weights_report(fast).kernel == "cpu_int4pack"
        # two decoder layers, each within the bf16 bound above: a few parts in a hundred of the logit scale
        assert (logits_of(fast, ids) - want).abs().max() <= 0.05 * float(want.abs().max())


def test_awq_respects_modules_to_not_convert_and_ties_embeddings(awq_folders):
    llama = load(awq_folders["llama"][0], weights="int4", kernel="reference")
    assert type(llama.get_submodule("model.layers.1.mlp.down_proj")) is nn.Linear
    assert isinstance(llama.get_submodule("model.layers.0.mlp.down_proj"), Int4Linear)
    qwen3 = load(awq_folders["qwen3"][0], weights="auto")
    assert qwen3.get_output_embeddings().weight is qwen3.get_input_embeddings().weight
    assert not any(p.is_meta for p in qwen3.parameters())


def test_an_awq_checkpoint_of_another_version_is_a_clear_error(awq_folders, tmp_path):
    folder, _ = awq_folders["qwen2"]
    copy_dir = tmp_path / "gemv"
    copy_dir.mkdir()
    for path in folder.iterdir():
        (copy_dir / path.name).write_bytes(path.read_bytes())
    config = json.loads((copy_dir / "config.json").read_text())
    config["quantization_config"]["version"] = "gemv"
    (copy_dir / "config.json").write_text(json.dumps(config))
    from engine.weights.loader import ModelLoadError

    with pytest.raises(ModelLoadError, match="GEMM"):
        load(copy_dir, weights="int4")


# -- report and fingerprint --------------------------------------------------------------------------------------

def test_weights_report_counts_packed_weights_scales_and_zeros(awq_folders):
    folder, expected = awq_folders["qwen2"]
    dense = weights_report(load(folder, weights="float"))
    int4 = load(folder, weights="int4", kernel="reference")
    report = weights_report(int4)
    assert dense.format == "float32" and dense.kernel == "dense"
    assert report.format == "awq-int4-g32" and report.kernel == "reference"
    held = {id(t): t for t in [*int4.parameters(), *int4.buffers()]}
    assert report.resident_bytes == sum(t.numel() * t.element_size() for t in held.values())
    # per linear of [out, in]: in*out/2 code bytes + (in/32)*out * (4 scale + 1 zero) bytes + bias
    linears = [m for m in int4.modules() if isinstance(m, Int4Linear)]
    assert report.linear_bytes == sum(m.in_features * m.out_features // 2 + m.in_features // 32 * m.out_features * 5
                                         + (4 * m.out_features if m.bias is not None else 0) for m in linears)
    assert report.linear_float32_bytes == dense.linear_bytes
    assert dense.resident_bytes - report.resident_bytes == dense.linear_bytes - report.linear_bytes


def test_the_fingerprint_tells_float_int4_group_sizes_and_kernels_apart(one_thread):
    base = build_model("llama")
    prints = {"float": fingerprint(base)}
    for group_size, kernel in [(32, "reference"), (64, "reference"), (32, "cpu_int4pack")]:
        if kernel == "cpu_int4pack" and CPU_FAST is not None:
            continue
        model = build_model("llama")
        quantize_model(model, group_size=group_size, kernel=kernel)
        prints[(group_size, kernel)] = fingerprint(model)
        assert fingerprint(model) == prints[(group_size, kernel)]  # stable
    assert len(set(prints.values())) == len(prints)
    one = build_model("llama")
    quantize_model(one, group_size=32, kernel="reference")
    with torch.no_grad():
        one.get_submodule("model.layers.0.self_attn.q_proj").scales.mul_(1.01)
    assert fingerprint(one) != prints[(32, "reference")]


def test_a_tiny_int4_model_serves_exact_hits_equal_to_full_prefill(one_thread):
    model = build_model("llama")
    quantize_model(model, group_size=32)
    engine = KVBoost(model, build_tokenizer(), EngineConfig.of(chunk_size=16, disk_cache_bytes=0))
    ids = random_ids(5 * 16 + 3, seed=21)
    engine.generate(ids, max_new_tokens=2)
    again = engine.generate(ids, max_new_tokens=2, return_logits=True)
    assert again.stats.reused_tokens >= 4 * 16
    assert (again.first_logits - engine.full_prefill_logits(ids).float().cpu()).abs().max() < 1e-4
    assert all(FIRST_WORD <= t < VOCAB for t in again.token_ids)


# -- the real model ----------------------------------------------------------------------------------------------

def test_load_model_quantizes_a_float_folder_at_load(tmp_path, one_thread):
    build_model("qwen3").save_pretrained(tmp_path)
    build_tokenizer().save_pretrained(tmp_path)
    dense, _ = load_model(resolve_source(str(tmp_path)), CPU, torch.float32)
    int4, _ = load_model(resolve_source(str(tmp_path)), CPU, torch.float32, weights="int4", group_size=32)
    report = weights_report(int4)
    assert weights_report(dense).format == "float32" and report.format == "int4-g32"
    assert report.num_int4_linears == 14 and report.resident_bytes < weights_report(dense).resident_bytes
    ids = random_ids(32, seed=4)
    want = logits_of(dense, ids)
    # 4-bit codes of random init weights: the logits move, by a fraction of their scale (11% measured)
    assert 0 < (logits_of(int4, ids) - want).abs().max() < 0.25 * float(want.abs().max())


@pytest.fixture(scope="session")
def smollm_int4(smollm_float):
    """Int4 copies of the session's real model (SmolLM2-135M: hidden 576 is 9 groups of 64), one per kernel, made
    when first asked for: the GGUF is parsed once per session, by the shared `smollm_float` fixture."""
    copies = {}

    def get(kernel: str) -> KVBoost:
        if kernel not in copies:
            model = copy.deepcopy(smollm_float.model)
            quantize_model(model, group_size=64, kernel=kernel)
            copies[kernel] = KVBoost(model, smollm_float.tokenizer, EngineConfig.of(chunk_size=64, disk_cache_bytes=0))
        return copies[kernel]
    return get


@needs_cpu_kernel
def test_smollm_int4_holds_a_fifth_of_the_float_linears_and_answers(smollm_float, smollm_int4):
    engine = smollm_int4("cpu_int4pack")
    report = weights_report(engine.model)
    assert report.format == "int4-g64" and report.kernel == "cpu_int4pack"
    assert report.num_int4_linears == 30 * 7
    assert report.linear_bytes < report.linear_float32_bytes / 5
    assert engine.fingerprint != smollm_float.fingerprint
    result = engine.chat([{"role": "user", "content": "What is the capital of France?"}], max_new_tokens=12)
    assert "Paris" in result.text


@pytest.mark.parametrize("kernel", ["reference", pytest.param("cpu_int4pack", marks=needs_cpu_kernel)])
def test_an_exact_hit_after_int4_load_equals_full_prefill_at_the_same_weights(smollm_int4, kernel):
    import pydoc_data.topics

    engine = smollm_int4(kernel)
    engine.clear_cache()
    system = {"role": "system", "content": pydoc_data.topics.topics["assignment"][:1200]}
    messages = [system, {"role": "user", "content": "What does an augmented assignment do?"}]
    engine.warm([system])
    result = engine.chat(messages, max_new_tokens=1, return_logits=True)
    ids = engine.encode(messages)
    assert result.stats.reused_tokens > 0.7 * len(ids)
    assert "EXACT" in {kind for _, _, kind in result.stats.chunks}
    full = engine.full_prefill_logits(ids).float().cpu()
    if kernel == "reference":  # float32 numerics: as exact as reuse on the float model
        assert (result.first_logits - full).abs().max() < 1e-4
    else:
        # The kernel is batch-invariant but rounds every linear's input to bfloat16; under float32 attention the
        # ~1e-7 differences two attention shapes make flipped some of those roundings (0.11 of 20 in the logits).
        # The engine runs such models on row-by-row (or float64) attention (engine.exact_attention): the same logits.
        assert engine.model.config._attn_implementation in EXACT
        assert torch.equal(result.first_logits, full)


# -- CUDA and the GPU check script -------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_tinygemm_matches_the_reference_within_bf16_rounding(group_size):
    if kernel_unavailable("tinygemm", "cuda") is not None:
        pytest.skip(kernel_unavailable("tinygemm", "cuda"))
    g = torch.Generator().manual_seed(group_size)
    weight, bias = torch.randn(512, 1152, generator=g) * 0.05, torch.randn(512, generator=g) * 0.1
    reference = Int4Linear.from_float(weight, bias, group_size, "reference")
    fast = Int4Linear.from_float(weight.cuda(), bias.cuda(), group_size, "tinygemm")
    x = torch.randn(9, 1152, generator=g)
    exact = reference(x)
    got = fast(x.cuda().to(torch.bfloat16)).float().cpu()
    _, scales, _ = quantize_rtn(weight, group_size)
    bound = bf16_bound(x, reference.dequantize(torch.float32), scales, group_size, exact) + 2**-9 * exact.abs()
    assert torch.all((got - exact).abs() <= bound)


def test_the_gpu_check_runs_end_to_end_on_the_cpu_with_tiny_shapes():
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--dry-run"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| model | linear |" in done.stdout  # the markdown tables, then the numbers as one JSON line
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["dry_run"] is True
    assert {row["model"] for row in report["correctness"]} == {"7b-llama", "7b-qwen", "32b-qwen"}
    assert len(report["correctness"]) == 3 * 5
    assert all(0 < row["max_abs_err"] and row["err_over_bound"] <= 1 for row in report["correctness"])
    assert report["decode"]["tokens_per_s"] > 0 and report["decode"]["bandwidth_bound_tokens_per_s"] > 0
    streaming = report["streaming"]  # a six-layer stack planned so that half its layers stream
    assert streaming["resident_layers"] > 0 and streaming["streamed_layers"] > 0
    assert streaming["decode_tokens_per_s"] > 0 and streaming["bound_tokens_per_s"] > 0
    assert streaming["pinned_one_copy_gb_s"] > 0 and streaming["prefill_tokens_per_s"] > 0
    assert streaming["tokens_per_pass"] > 1  # the prefill and the 8-token passes spread each weight pass
    assert report["failed"] == {}
    engine = report["engine"]  # the engine's own decode, float and int4, per body and context, against the limit
    assert {(r["body"], r["weights"], r["context"]) for r in engine} == {
        (body, weights, context) for body in ("1.5b-qwen2", "7b-mistral") for weights in ("float", "int4")
        for context in (32, 96)}
    for row in engine:
        # (no bound on the share here: a tiny model's bytes sit in the CPU's caches, faster than the copy measured)
        assert row["new_tokens"] == 8 and row["decode_tps"] > 0 and row["share"] > 0 and row["limit_tps"] > 0
        assert row["bytes_per_token"] > 0 and row["transformers_decode_tps"] > 0 and row["eager_decode_tps"] > 0
        assert row["graphs"] is False and "cpu" in row["graphs_unavailable"]  # CUDA graphs need a CUDA device
    int4 = {(r["body"], r["context"]): r["bytes_per_token"] for r in engine if r["weights"] == "int4"}
    assert all(int4[r["body"], r["context"]] < r["bytes_per_token"] for r in engine if r["weights"] == "float")
