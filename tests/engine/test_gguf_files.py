"""The tests' own K-quant packers against gguf-py's dequantize, and GGUF files that lie: each one a ModelLoadError
naming the tensor or key and the numbers, in bounded time, before anything of the lying size is allocated."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from gguf_files import pack_q4_k, pack_q5_k, pack_q6_k, patch, string_end, tensor_info_fields, tensor_shapes, tiny_gguf

from engine.weights.gguf_file import read_gguf
from engine.weights.loader import ModelLoadError, load_model, resolve_source

CPU = torch.device("cpu")


# -- the packers -------------------------------------------------------------------------------------------------

def random_fields(n: int, levels: int, seed: int):
    rng = np.random.default_rng(seed)
    d = (rng.standard_normal(n) * 0.01).astype(np.float16).astype(np.float32)
    dmin = np.abs(rng.standard_normal(n) * 0.01).astype(np.float16).astype(np.float32)
    sc, m = rng.integers(0, 64, (n, 8), dtype=np.uint8), rng.integers(0, 64, (n, 8), dtype=np.uint8)
    return d, dmin, sc, m, rng.integers(0, levels + 1, (n, 256), dtype=np.uint8)


@pytest.mark.parametrize("kind,levels,pack", [("Q4_K", 15, pack_q4_k), ("Q5_K", 31, pack_q5_k)])
def test_the_k_quant_packers_write_what_gguf_dequantizes(kind, levels, pack):
    d, dmin, sc, m, q = random_fields(6, levels, seed=levels)
    blocks = pack(d, dmin, sc, m, q)
    assert blocks.shape == (6, {"Q4_K": 144, "Q5_K": 176}[kind])
    got = quants.dequantize(blocks, GGMLQuantizationType[kind])
    # gguf's order: (d * sc) * q - dmin * m, each product in float32
    scale = np.repeat(d[:, None] * sc.astype(np.float32), 32, axis=1)
    offset = np.repeat(dmin[:, None] * m.astype(np.float32), 32, axis=1)
    assert np.array_equal(got, scale * q.astype(np.float32) - offset)


def test_the_q6_k_packer_writes_what_gguf_dequantizes():
    rng = np.random.default_rng(6)
    d = (rng.standard_normal(5) * 0.01).astype(np.float16).astype(np.float32)
    scales = rng.integers(-128, 128, (5, 16)).astype(np.int8)
    q = rng.integers(0, 64, (5, 256), dtype=np.uint8)
    got = quants.dequantize(pack_q6_k(d, scales, q), GGMLQuantizationType.Q6_K)
    want = np.repeat(d[:, None] * scales.astype(np.float32), 16, axis=1) * (q.astype(np.float32) - 32)
    assert np.array_equal(got, want)


# -- lying files -------------------------------------------------------------------------------------------------

@pytest.fixture
def good(tmp_path):
    return tiny_gguf(tmp_path / "good.gguf", "Q4_K", sizes=dict(layers=1))


def refused(path, **options) -> str:
    """The ModelLoadError's message of loading `path`, which must come within 20 s."""
    start = time.perf_counter()
    with pytest.raises(ModelLoadError) as error:
        load_model(resolve_source(str(path)), CPU, torch.float32, **options)
    assert time.perf_counter() - start < 20
    return str(error.value)


def test_a_good_file_loads(good):
    model, _ = load_model(resolve_source(str(good)), CPU, torch.float32, weights="int4")
    assert model.config.num_hidden_layers == 1


def test_a_tensor_count_beyond_the_file_is_refused(good):
    patch(good, 8, "Q", 10**12)
    assert "says 1000000000000 tensors" in refused(good)


def test_a_metadata_count_beyond_the_file_is_refused(good):
    patch(good, 16, "Q", 2**62)
    assert f"says {2**62} metadata values" in refused(good)


def test_an_array_longer_than_the_file_is_refused_at_once(good):
    # gguf-py's reader walks such an array one item at a time to the end of the file (and for one-byte items,
    # which read as empty there and take no bytes, for good)
    patch(good, string_end(good, "tokenizer.ggml.token_type") + 8, "Q", 2**60)
    message = refused(good)
    assert "tokenizer.ggml.token_type" in message and str(2**60) in message


def test_a_string_longer_than_the_file_is_refused(good):
    patch(good, string_end(good, "general.name") + 4, "Q", 2**40)  # the value's length, after its type
    assert "metadata 'general.name'" in refused(good)


def test_a_data_offset_past_the_end_is_refused_naming_the_tensor(good):
    _, offset_at = tensor_info_fields(good, "blk.0.ffn_down.weight", 2)
    patch(good, offset_at, "Q", 2**40)
    message = refused(good)
    assert "blk.0.ffn_down.weight" in message and "ends past the end of the file" in message


def test_an_unaligned_data_offset_is_refused(good):
    _, offset_at = tensor_info_fields(good, "blk.0.ffn_down.weight", 2)
    with open(good, "rb") as handle:
        handle.seek(offset_at)
        offset = int.from_bytes(handle.read(8), "little")
    patch(good, offset_at, "Q", offset + 4)
    assert "not a multiple of the alignment 32" in refused(good)


def test_a_shape_larger_than_the_file_is_refused_before_it_is_allocated(good):
    dims_at = string_end(good, "token_embd.weight") + 4
    patch(good, dims_at + 8, "Q", 2**31)  # rows of the table: 2^31 x 256 float32, 2 TiB
    message = refused(good)
    assert "token_embd.weight" in message and "ends past the end of the file" in message


def test_an_unknown_tensor_type_is_refused(good):
    type_at, _ = tensor_info_fields(good, "blk.0.attn_norm.weight", 1)
    patch(good, type_at, "I", 99)
    assert "tensor 'blk.0.attn_norm.weight' has type 99, which is no GGML tensor type" in refused(good)


def test_a_tensor_type_no_path_reads_is_refused_naming_it(good):
    type_at, _ = tensor_info_fields(good, "blk.0.attn_norm.weight", 1)
    patch(good, type_at, "I", int(GGMLQuantizationType.I32))  # as many bytes as F32
    message = refused(good)
    assert "'blk.0.attn_norm.weight' is I32, which this loader does not read" in message


def test_a_missing_tensor_is_refused_naming_it(tmp_path):
    path = tiny_gguf(tmp_path / "m.gguf", "Q4_0", sizes=dict(layers=1), drop=("blk.0.ffn_up.weight",))
    assert "lacks 1 tensor(s) the config needs: blk.0.ffn_up.weight (model.layers.0.mlp.up_proj.weight)" in \
        refused(path)


def test_a_shape_that_disagrees_with_the_config_is_refused(tmp_path):
    from gguf_files import random_tensors, write_gguf

    values = random_tensors(tensor_shapes("llama", dict(layers=1)))
    values["blk.0.ffn_gate.weight"] = values["blk.0.ffn_gate.weight"][:256]  # 256 rows, the config says 512
    path = write_gguf(tmp_path / "s.gguf", {n: (v, "F32") for n, v in values.items()}, sizes=dict(layers=1))
    message = refused(path)
    assert "'blk.0.ffn_gate.weight' has shape [256, 256], but the config makes" in message
    assert "model.layers.0.mlp.gate_proj.weight [512, 256]" in message


def test_a_config_of_more_layers_than_the_file_could_hold_is_refused(good):
    patch(good, string_end(good, "llama.block_count") + 4, "I", 100000)
    message = refused(good)
    assert "100000 layers" in message or "num_hidden_layers" in message


def test_a_truncated_file_and_a_file_that_is_not_gguf_are_refused(good, tmp_path):
    data = good.read_bytes()
    half = tmp_path / "half.gguf"
    half.write_bytes(data[:len(data) // 2])
    assert "ends past the end of the file" in refused(half)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"\x00" * 4096)
    assert "does not start with the GGUF magic bytes" in refused(junk)


def test_the_header_reader_checks_without_reading_tensor_data(good):
    file = read_gguf(good)
    assert file.data_start % 32 == 0 and file.metadata_end < file.data_start
    last = max(file.tensors.values(), key=lambda r: r.offset)
    assert last.offset + last.nbytes <= file.size
    assert file.tensors["blk.0.attn_q.weight"].shape == (256, 256)
