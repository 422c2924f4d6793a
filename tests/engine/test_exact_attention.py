"""Attention one query row at a time (engine.exact_attention.rows, engine/exact_attention.c): the softmax attention
float64 sdpa computes, and for every row the same bits however the queries are cut, batched or threaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.exact_attention import row_attention, rows, rows_unavailable

pytestmark = pytest.mark.skipif(rows_unavailable() is not None, reason=f"no C kernel: {rows_unavailable()}")
SCALE = 64 ** -0.5


def qkv(batch=2, heads=6, kv_heads=2, n=40, dim=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, heads, n, dim, generator=gen), torch.randn(batch, kv_heads, n, dim, generator=gen),
            torch.randn(batch, kv_heads, n, dim, generator=gen))


def reference(q, k, v, mask=None, causal=True):
    """float64 sdpa over repeated kv heads, [B, nq, H, D]."""
    groups = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(groups, 1),
                                         v.double().repeat_interleave(groups, 1), attn_mask=mask,
                                         is_causal=causal and mask is None)
    return out.transpose(1, 2)


def test_rows_compute_the_softmax_attention_of_float64_sdpa():
    q, k, v = qkv()
    assert (rows(q, k, v, None, True, SCALE).double() - reference(q, k, v)).abs().max() < 2e-6
    assert (rows(q, k, v, None, False, SCALE).double() - reference(q, k, v, causal=False)).abs().max() < 2e-6


@pytest.mark.parametrize("dim", [64, 128, 36])  # the sums held in registers (64, 128), in memory (36)
def test_a_row_is_the_same_however_the_queries_are_cut_batched_or_threaded(dim):
    q, k, v = qkv(dim=dim)
    whole = rows(q, k, v, None, True, SCALE)
    pieces = torch.cat([rows(q[:, :, :13], k[:, :, :13], v[:, :, :13], None, True, SCALE),
                        rows(q[:, :, 13:], k, v, None, True, SCALE)], dim=1)
    one_by_one = torch.cat([rows(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1], None, True, SCALE)
                            for i in range(q.shape[2])], dim=1)
    alone = torch.cat([rows(q[b:b + 1], k[b:b + 1], v[b:b + 1], None, True, SCALE) for b in range(2)])
    # keys past a query, masked out, change nothing: a prefill of a longer prompt
    longer = rows(q[:, :, :20], k, v, torch.ones(40, 40, dtype=torch.bool).tril()[None, None, :20], False, SCALE)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = rows(q, k, v, None, True, SCALE)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(whole, other) for other in (pieces, one_by_one, alone, single))
    assert torch.equal(longer, whole[:, :20])


class _Module(torch.nn.Module):
    """What the attention interface reads of an attention module."""
    is_causal = True
    training = False
    num_key_value_groups = 3


def test_transformers_masks_boolean_and_additive_padding_included():
    q, k, v = qkv()
    keep = torch.ones(2, 1, 40, 40, dtype=torch.bool).tril()
    keep[1, :, :, :5] = False  # the second sequence is left-padded by 5
    keep[1, :, :5, :] = False  # its padding rows attend nothing: 0 here
    additive = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    got_bool, _ = row_attention(_Module(), q, k, v, keep, scaling=SCALE)
    got_add, _ = row_attention(_Module(), q, k, v, additive, scaling=SCALE)
    assert torch.equal(got_bool, got_add)
    want = reference(q[:, :, 5:], k, v, mask=keep[:, :, 5:].expand(2, 6, 35, 40), causal=False)
    assert (got_bool[:, 5:].double() - want).abs().max() < 2e-6
    assert not got_bool[1, :5].any()


def test_a_mask_with_biases_takes_the_float64_path():
    q, k, v = qkv()
    bias = torch.randn(2, 1, 40, 40) * 0.1
    got, _ = row_attention(_Module(), q, k, v, bias, scaling=SCALE)
    assert (got.double() - reference(q, k, v, mask=bias.double().expand(2, 6, 40, 40), causal=False)).abs().max() \
        < 2e-6


def test_a_caches_view_of_its_first_positions_is_read_in_place_with_the_same_result():
    """The live cache hands attention [:, :, :n] of a larger buffer: read through its strides, no copy."""
    q, k, v = qkv(n=40)
    key_buffer, value_buffer = torch.zeros(2, 2, 64, 64), torch.zeros(2, 2, 64, 64)
    key_buffer[:, :, :40], value_buffer[:, :, :40] = k, v
    view_k, view_v = key_buffer[:, :, :40], value_buffer[:, :, :40]
    assert not view_k.is_contiguous()
    assert torch.equal(rows(q, view_k, view_v, None, True, SCALE), rows(q, k, v, None, True, SCALE))
    with pytest.raises(ValueError, match="attention mask"):
        rows(q, k, v, torch.ones(2, 1, 40, 39, dtype=torch.bool), False, SCALE)


# rows() of an AVX2 (haswell) build of the kernel, in a child process (a build's vector path is fixed at load)
AVX2_CHILD = """
import json, sys, torch
from engine.exact_attention import rows
from engine.weights import gguf_blocks
sys.path.insert(0, sys.argv[1])
from test_exact_attention import cases
print(json.dumps({"path": gguf_blocks.vector_path(),
                  "out": [rows(q, k, v, mask, causal, scale).tolist() for q, k, v, mask, causal, scale in cases()]}))
"""


def cases():
    """Shapes every path of the kernel takes: head sizes 64 and 128 (sums in registers, rows in pairs or in groups
    of up to 4 and 2), 48 (keys eight at a time, sums in memory), 36 (one key at a time); enough rows for the keys
    in blocks of 16 (64 rows per kv head and more: 64 and 48); three query heads per kv head, so that a tile of
    rows spans heads and its last group of weighted sums is short (a check of 5 tokens and one of 3); causal with
    more keys than queries; a mask."""
    out = []
    for dim, heads, nq, nk in ((64, 4, 21, 37), (128, 4, 9, 9), (48, 4, 5, 19), (36, 4, 4, 11), (64, 4, 40, 53),
                               (48, 4, 33, 33), (64, 6, 5, 203), (128, 6, 3, 70), (64, 6, 1, 90)):
        q, k, v = qkv(batch=1, heads=heads, kv_heads=2, n=nk, dim=dim, seed=dim + heads)
        out.append((q[:, :, nk - nq:], k, v, None, True, dim ** -0.5))
    q, k, v = qkv(batch=1, heads=2, kv_heads=1, n=23, dim=64, seed=3)
    mask = torch.rand(1, 1, 23, 23, generator=torch.Generator().manual_seed(1)) > 0.3
    out.append((q, k, v, mask, False, SCALE))
    return out


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="builds for another x86 CPU")
def test_an_avx2_build_attends_with_the_same_bits_as_this_build(tmp_path):
    """KV computed on a machine with AVX-512 is served to one with AVX2 only (disk, the shared tier): their row
    attention must agree bit for bit (a lane's chain of multiply-adds is the same in 8 lanes as in 16)."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "KVBOOST_CACHE_DIR": str(tmp_path), "KVBOOST_BLOCKS_MARCH": "haswell"}
    done = subprocess.run([sys.executable, "-c", AVX2_CHILD, str(Path(__file__).parent)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["path"] == "avx2"
    for got, (q, k, v, mask, causal, scale) in zip(result["out"], cases(), strict=True):
        assert torch.equal(torch.tensor(got), rows(q, k, v, mask, causal, scale))


FINGERPRINT_CHILD = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from engine.exact_attention import ROWS, register
from engine.weights.fingerprint import fingerprint
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1))
model.config._attn_implementation = register(ROWS)
print(fingerprint(model))
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="builds for other x86 CPUs")
def test_a_portable_build_files_its_kv_apart_from_a_vector_builds(tmp_path):
    """A portable C build sums a dot product in order, a vector build in 16 chains: their rows differ in the last
    bits, so a shared store must never hand one's KV to the other. AVX2 and AVX-512 builds give the same bits
    (above) and share a fingerprint."""
    root = Path(__file__).resolve().parents[2]

    def fingerprint_with(march: str) -> str:
        env = {**os.environ, "KVBOOST_CACHE_DIR": str(tmp_path / march), "KVBOOST_BLOCKS_MARCH": march}
        done = subprocess.run([sys.executable, "-c", FINGERPRINT_CHILD], cwd=root, env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip().splitlines()[-1]

    native = fingerprint_with("native")
    assert fingerprint_with("haswell") == native
    assert fingerprint_with("x86-64") != native
