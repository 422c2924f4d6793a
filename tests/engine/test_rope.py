"""Re-rotation of cached keys: tiny random-weight models of every verified architecture and RoPE variant, plus
float64 references of the pure maths.

The identity tested: a chunk computed alone at positions [p, p+T) and re-rotated to q has the keys of the same
chunk computed alone at [q, q+T). A chunk alone attends only within itself, so every layer sees the same
relative positions in both runs and its raw (pre-RoPE) keys agree up to float32 rounding."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.cohere.modeling_cohere import apply_rotary_pos_emb as cohere_apply_rope
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_apply_rope

from engine.rope import (
    VERIFIED_MODEL_TYPES,
    RopeParams,
    can_rerotate,
    delta_rotation,
    rerotate_keys,
    rerotate_kv,
    rope_params,
)

NUM_TOKENS = 16
MOVES = [(0, 37), (1500, 37), (0, 1500)]  # p < q, p > q, a large delta: three forward passes per model

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=4096,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
ARCH_EXTRAS = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "gemma3_text": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=64),
    "smollm3": dict(no_rope_layers=[1, 0]),  # second layer is NoPE: its keys must not move
}
EAGER_ONLY = {"gemma2"}  # Gemma2 has no sdpa path in this transformers


def longrope(rotary_dim: int, original_max: int) -> dict:
    half = rotary_dim // 2
    return dict(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                 "short_factor": [1.0 + 0.25 * i for i in range(half)],
                                 "long_factor": [2.0 + 1.5 * i for i in range(half)]},
                original_max_position_embeddings=original_max)


VARIANTS = {
    "linear": ("llama", dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})),
    "dynamic": ("llama", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
                              max_position_embeddings=2048)),
    "yarn": ("llama", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                            "original_max_position_embeddings": 1024})),
    "yarn_mscale": ("qwen2", dict(rope_parameters={"rope_type": "yarn", "factor": 8.0, "rope_theta": 10000.0,
                                                   "original_max_position_embeddings": 512, "mscale": 1.0,
                                                   "mscale_all_dim": 0.5})),
    "llama3": ("llama", dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 256,
                                              "rope_theta": 10000.0})),
    "longrope_short": ("phi3", longrope(16, original_max=2048)),
    "phi3_partial": ("phi3", dict(partial_rotary_factor=0.5)),
    "longrope_partial": ("phi3", dict(partial_rotary_factor=0.5, **longrope(8, original_max=2048))),
    "gemma3_local_global": ("gemma3_text", dict(rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}})),
}


pytestmark = pytest.mark.usefixtures("one_thread")


def variant_model(variant: str):
    model_type, overrides = VARIANTS[variant]
    return tiny_model(model_type, **overrides)


def tiny_model(model_type: str, **overrides):
    settings = {**TINY, **ARCH_EXTRAS.get(model_type, {}), **overrides}
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(0)
    attn = "eager" if model_type in EAGER_ONLY else "sdpa"
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32).eval()


@torch.no_grad()
def chunk_kv(model, ids: torch.Tensor, start: int):
    """KV of `ids` computed alone at positions [start, start + T): per layer (k, v), [1, H_kv, T, D]."""
    positions = torch.arange(start, start + ids.shape[-1])[None]
    cache = model(ids, position_ids=positions, use_cache=True).past_key_values
    return tuple((layer.keys.clone(), layer.values.clone()) for layer in cache.layers)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def assert_moves_exactly(model, moves, *, context_len=1):
    params = rope_params(model, context_len=context_len)
    ids = torch.randint(3, 512, (1, NUM_TOKENS), generator=torch.Generator().manual_seed(1))
    starts = sorted({pos for move in moves for pos in move})
    kv_at = {start: chunk_kv(model, ids, start) for start in starts}
    for p, q in moves:
        assert can_rerotate(params, p + NUM_TOKENS, q + NUM_TOKENS)
        moved = rerotate_kv(kv_at[p], p, q, params)
        for layer, ((k_moved, v_moved), (k_q, v_q), (k_p, _)) in enumerate(zip(moved, kv_at[q], kv_at[p])):
            where = f"layer {layer}, {p} -> {q}"
            assert cosine(k_moved, k_q) >= 0.99999, where
            # Cosine ignores scale: the relative error also catches attention scaling applied twice.
            assert relative_error(k_moved, k_q) < 1e-4, where
            if layer == 0:  # nothing positional has happened before layer 0's values
                assert torch.equal(v_moved, v_q), where
            else:  # later values depend on positions only through float32 rounding of attention
                torch.testing.assert_close(v_moved, v_q, rtol=0, atol=1e-5)
            if p != q and params[layer].rotary_dim:
                assert relative_error(k_p, k_q) > 1e-2, f"{where}: positions did not change the keys"


# -- identity on real architectures ---------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", sorted(VERIFIED_MODEL_TYPES))
def test_rerotated_keys_equal_keys_computed_at_target(model_type):
    assert_moves_exactly(tiny_model(model_type), MOVES)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rerotation_is_exact_for_rope_variant(variant):
    assert_moves_exactly(variant_model(variant), MOVES)


def test_longrope_long_factors_move_exactly_while_both_contexts_are_long():
    model = tiny_model("phi3", **longrope(16, original_max=256))
    short, long = rope_params(model)[0], rope_params(model, context_len=1000)[0]
    assert not torch.equal(short.inv_freq, long.inv_freq)
    assert (short.max_context, long.min_context) == (256, 257)
    assert_moves_exactly(model, [(300, 1500), (1500, 400)], context_len=1000)


def test_scaled_variants_report_their_attention_scaling():
    yarn = rope_params(variant_model("yarn"))[0]
    assert yarn.attention_scaling == pytest.approx(0.1 * math.log(4.0) + 1.0)
    phi3 = rope_params(variant_model("longrope_short"))[0]
    assert phi3.attention_scaling == pytest.approx(math.sqrt(1 + math.log(4096 / 2048) / math.log(2048)))


def test_partial_rotary_and_nope_layers_keep_position_free_dims():
    phi = rope_params(tiny_model("phi"))  # PhiConfig defaults to partial_rotary_factor=0.5
    assert [p.rotary_dim for p in phi] == [8, 8]
    smollm3 = rope_params(tiny_model("smollm3"))
    assert [p.rotary_dim for p in smollm3] == [16, 0]
    k = torch.randn(1, 2, NUM_TOKENS, 16)
    assert torch.equal(rerotate_keys(k, 0, 900, phi[0])[..., 8:], k[..., 8:])
    assert rerotate_keys(k, 0, 900, smollm3[1]) is k


def test_cohere_and_glm_use_interleaved_pairs():
    assert rope_params(tiny_model("cohere"))[0].interleaved
    assert rope_params(tiny_model("glm"))[0].interleaved
    assert not rope_params(tiny_model("llama"))[0].interleaved


# -- where re-rotation is not exact, and says so --------------------------------------------------------------

def assert_moved_keys_differ(model, p, q, params):
    ids = torch.randint(3, 512, (1, NUM_TOKENS), generator=torch.Generator().manual_seed(2))
    kv_p, kv_q = chunk_kv(model, ids, p), chunk_kv(model, ids, q)
    moved = rerotate_kv(kv_p, p, q, params)
    assert max(relative_error(k_m, k_q) for (k_m, _), (k_q, _) in zip(moved, kv_q)) > 1e-3


def test_dynamic_ntk_beyond_original_length_is_reported_inexact():
    model = tiny_model("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
                       max_position_embeddings=512)
    params = rope_params(model)
    assert can_rerotate(params, NUM_TOKENS, 511)
    assert not can_rerotate(params, NUM_TOKENS, 1000 + NUM_TOKENS)
    # The guard is needed: past 512 tokens the model computes keys with other frequencies.
    assert_moved_keys_differ(model, 0, 1000, params)


def test_longrope_across_the_factor_switch_is_reported_inexact():
    model = tiny_model("phi3", **longrope(16, original_max=256))
    source, target = NUM_TOKENS, 1500 + NUM_TOKENS
    assert not can_rerotate(rope_params(model), source, target)
    assert not can_rerotate(rope_params(model, context_len=target), source, target)
    assert_moved_keys_differ(model, 0, 1500, rope_params(model))


def test_gemma3_global_layers_need_their_own_frequencies():
    model = variant_model("gemma3_local_global")
    local, global_ = rope_params(model)
    assert (local.rope_type, global_.rope_type) == ("default", "linear")
    assert_moved_keys_differ(model, 0, 1500, (local, local))


def test_model_without_verified_rope_layout_is_refused():
    model = tiny_model("gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=64)
    with pytest.raises(ValueError, match="gpt2"):
        rope_params(model)


# -- the pure maths against float64 references ----------------------------------------------------------------

def params_for(inv_freq: torch.Tensor, *, interleaved=False) -> RopeParams:
    return RopeParams("default", inv_freq.double(), 1.0, interleaved)


def rotation_matrix(angles: torch.Tensor, head_dim: int, interleaved: bool) -> torch.Tensor:
    """[D, D] rotation acting on column vectors: pairs of dims turned by `angles` [R/2], the rest fixed."""
    m = torch.eye(head_dim, dtype=torch.float64)
    half = angles.numel()
    for i, a in enumerate(angles.tolist()):
        x, y = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
        m[x, x], m[x, y], m[y, x], m[y, y] = math.cos(a), -math.sin(a), math.sin(a), math.cos(a)
    return m


@pytest.mark.parametrize("interleaved", [False, True])
def test_rerotation_matches_explicit_rotation_matrices(interleaved):
    g = torch.Generator().manual_seed(3)
    inv_freq = torch.rand(6, generator=g, dtype=torch.float64)  # rotary dim 12 of head dim 16
    params = params_for(inv_freq, interleaved=interleaved)
    k = torch.randn(2, 3, 5, 16, generator=g, dtype=torch.float64)
    from_pos, to_pos = torch.tensor([4, 0, 99, 7, 2000]), torch.tensor([10, 3, 1, 7, 5])
    expected = torch.empty_like(k)
    for t in range(5):
        m = rotation_matrix((to_pos[t] - from_pos[t]).double() * inv_freq, 16, interleaved)
        expected[..., t, :] = k[..., t, :] @ m.T
    torch.testing.assert_close(rerotate_keys(k, from_pos, to_pos, params), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_scaled_cached_keys_move_without_rescaling(layout):
    """HF caches s * R(p) k (both cos and sin carry the attention scaling s); moving it to q must give s * R(q) k."""
    g = torch.Generator().manual_seed(4)
    s, inv_freq = 1.2079, torch.rand(8, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, NUM_TOKENS, 16, generator=g, dtype=torch.float64)
    interleaved = layout == "interleaved"
    apply_rope = cohere_apply_rope if interleaved else llama_apply_rope

    def cached_at(start: int) -> torch.Tensor:
        freqs = torch.arange(start, start + NUM_TOKENS, dtype=torch.float64)[None, :, None] * inv_freq
        emb = freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat((freqs, freqs), dim=-1)
        _, k_rot = apply_rope(k, k, emb.cos() * s, emb.sin() * s)
        return k_rot

    params = RopeParams("yarn", inv_freq, s, interleaved)
    for p, q in MOVES + [(300, 5)]:
        torch.testing.assert_close(rerotate_keys(cached_at(p), p, q, params), cached_at(q), rtol=0, atol=1e-12)


def test_moving_there_and_back_is_the_identity():
    params = params_for(1.0 / 10000 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    k = torch.randn(1, 2, NUM_TOKENS, 16, dtype=torch.float64)
    there = rerotate_keys(k, 3, 123_456, params)
    torch.testing.assert_close(rerotate_keys(there, 123_456, 3, params), k, rtol=0, atol=1e-12)
    # Two steps round twice: float64 angles near 1e5 rad carry ~1e-11 absolute error.
    torch.testing.assert_close(rerotate_keys(rerotate_keys(k, 3, 50, params), 50, 123_456, params), there,
                               rtol=0, atol=1e-10)


def test_scalar_start_equals_per_token_positions():
    params = params_for(torch.rand(8, dtype=torch.float64))
    k = torch.randn(1, 2, NUM_TOKENS, 16)
    by_start = rerotate_keys(k, 40, 7, params)
    by_token = rerotate_keys(k, torch.arange(40, 40 + NUM_TOKENS), torch.arange(7, 7 + NUM_TOKENS), params)
    assert torch.equal(by_start, by_token)


def test_half_precision_keys_come_back_in_their_dtype():
    params = params_for(torch.rand(8, dtype=torch.float64))
    k = torch.randn(1, 2, NUM_TOKENS, 16)
    moved = rerotate_keys(k.bfloat16(), 0, 777, params)
    assert moved.dtype == torch.bfloat16
    torch.testing.assert_close(moved.float(), rerotate_keys(k, 0, 777, params), rtol=2e-2, atol=2e-2)


def test_rotation_is_formed_from_the_exact_integer_delta():
    params = params_for(torch.tensor([1.0, 1e-3], dtype=torch.float64))
    cos, sin = delta_rotation(2**40 + 5, 2**40 + 12, params, 1)  # float32 positions could not tell these apart
    torch.testing.assert_close(cos, torch.tensor([[math.cos(7.0), math.cos(7e-3)]], dtype=torch.float64))
    torch.testing.assert_close(sin, torch.tensor([[math.sin(7.0), math.sin(7e-3)]], dtype=torch.float64))


def test_misuse_raises_with_the_bad_values():
    params = params_for(torch.rand(8, dtype=torch.float64))
    k = torch.randn(1, 2, NUM_TOKENS, 16)
    with pytest.raises(ValueError, match="3 position deltas for 16 tokens"):
        rerotate_keys(k, torch.arange(3), torch.arange(3), params)
    with pytest.raises(ValueError, match="integers"):
        rerotate_keys(k, 0.5, 2, params)
    with pytest.raises(ValueError, match="head dim 8"):
        rerotate_keys(k[..., :8], 0, 2, params)
    with pytest.raises(ValueError, match="2 KV layers but 1"):
        rerotate_kv(((k, k), (k, k)), 0, 2, (params,))
