"""Model files whose bytes are hostile rather than their header's numbers: a NaN or infinite fp16 scale in one
block, a non-finite value in a float table or norm, a tensor whose type was swapped, and a file cut short while
it is being read. Each is a ModelLoadError naming the tensor (and block and row) or the byte where the file
ended, never a model that answers with NaN logits, and never a process killed by SIGBUS."""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_files import patch, tensor_info_fields, tiny_gguf
from processes import child_env

from engine.weights import gguf_blocks
from engine.weights.gguf_file import read_gguf
from engine.weights.loader import ModelLoadError, default_model_path, load_model, resolve_source

CPU = torch.device("cpu")
NAN, INF, MINUS_INF = 0x7E00, 0x7C00, 0xFC00  # fp16 bit patterns
# The two read paths of a quantized linear: the block kernel keeps the file's bytes (read straight into the
# layer), float dequantizes them (read a slice of rows at a time).
READ_PATHS = [pytest.param(dict(weights="int4", kernel="gguf_blocks"), id="blocks",
                           marks=pytest.mark.skipif(gguf_blocks.unavailable() is not None,
                                                    reason="block kernel unavailable")),
              pytest.param(dict(weights="float"), id="float")]


def refused(path, **options) -> str:
    with pytest.raises(ModelLoadError) as error:
        load_model(resolve_source(str(path)), CPU, torch.float32, **options)
    return str(error.value)


def patch_block_field(path, tensor: str, row: int, block: int, block_bytes: int, field_at: int, bits: int) -> None:
    """Overwrite the fp16 field at byte `field_at` of block `block` of row `row` of `tensor` with `bits`."""
    record = read_gguf(path).tensors[tensor]
    row_bytes = record.nbytes // record.shape[0]
    patch(path, record.offset + row * row_bytes + block * block_bytes + field_at, "H", bits)


# -- non-finite scales and values ---------------------------------------------------------------------------------

@pytest.mark.parametrize("options", READ_PATHS)
def test_a_nan_scale_in_one_q8_0_block_is_refused_naming_the_tensor_block_and_row(tmp_path, options, one_thread):
    path = tiny_gguf(tmp_path / "q8.gguf", "Q8_0", sizes=dict(layers=1))
    # attn_q: llama's q rows are permuted at load; the message names the row as the file stores it
    patch_block_field(path, "blk.0.attn_q.weight", row=3, block=2, block_bytes=34, field_at=0, bits=NAN)
    message = refused(path, **options)
    assert "'blk.0.attn_q.weight' (Q8_0)" in message and "d of block 2 of row 3 is nan" in message


@pytest.mark.parametrize("options", READ_PATHS)
def test_an_infinite_d_in_one_q6_k_block_is_refused(tmp_path, options, one_thread):
    path = tiny_gguf(tmp_path / "q6.gguf", "Q6_K", sizes=dict(layers=1))
    # Q6_K: 128 bytes of low bits, 64 of high bits, 16 sub-scales, then d
    patch_block_field(path, "blk.0.ffn_down.weight", row=200, block=1, block_bytes=210, field_at=208, bits=INF)
    message = refused(path, **options)
    assert "'blk.0.ffn_down.weight' (Q6_K)" in message and "d of block 1 of row 200 is inf" in message


def test_a_minus_infinite_dmin_of_a_q4_k_block_is_refused(tmp_path, one_thread):
    path = tiny_gguf(tmp_path / "q4k.gguf", "Q4_K", sizes=dict(layers=1))
    patch_block_field(path, "blk.0.ffn_up.weight", row=511, block=0, block_bytes=144, field_at=2, bits=MINUS_INF)
    assert "'blk.0.ffn_up.weight' (Q4_K) has a non-finite scale: dmin of block 0 of row 511 is -inf" in \
        refused(path, weights="int4", kernel="reference", head="float")


def test_a_nan_in_one_row_of_an_f16_token_table_is_refused(tmp_path, one_thread):
    path = tiny_gguf(tmp_path / "f16.gguf", "Q8_0", table_type="F16", sizes=dict(layers=1))
    record = read_gguf(path).tensors["token_embd.weight"]
    patch(path, record.offset + (7 * record.shape[1] + 5) * 2, "H", NAN)
    message = refused(path, weights="float")
    assert "'token_embd.weight' (F16) has a non-finite value: row 7, column 5 is nan" in message


def test_an_infinite_norm_weight_is_refused(tmp_path, one_thread):
    path = tiny_gguf(tmp_path / "norm.gguf", "Q8_0", sizes=dict(layers=1))
    record = read_gguf(path).tensors["blk.0.ffn_norm.weight"]
    patch(path, record.offset + 4 * 100, "f", float("inf"))
    assert "'blk.0.ffn_norm.weight' (F32) has a non-finite value: row 0, column 100 is inf" in refused(path)


@pytest.fixture(scope="module")
def embedded_copy(tmp_path_factory):
    """The embedded model's file copied where a test may change it."""
    path = tmp_path_factory.mktemp("embedded") / "model.gguf"
    shutil.copyfile(default_model_path(), path)
    return path


def test_a_nan_offset_in_one_q4_1_block_of_the_real_model_is_refused(embedded_copy, tmp_path, one_thread):
    path = tmp_path / "model.gguf"
    shutil.copyfile(embedded_copy, path)
    # Q4_1: fp16 d, fp16 m, 16 bytes of nibbles
    patch_block_field(path, "blk.0.ffn_gate.weight", row=1000, block=17, block_bytes=20, field_at=2, bits=NAN)
    message = refused(path, weights="int4")
    assert "'blk.0.ffn_gate.weight' (Q4_1) has a non-finite scale: m of block 17 of row 1000 is nan" in message


# -- swapped types ------------------------------------------------------------------------------------------------

def test_a_q4_0_tensor_relabelled_q4_k_of_the_same_size_is_refused_by_its_scales(tmp_path, one_thread):
    """Q4_0 (18 bytes per 32 weights) and Q4_K (144 per 256) take the same bytes for rows of 256: the header's
    checks cannot tell. Read as Q4_K, the fp16 at bytes 2-3 of each 144 (dmin) is a Q4_0 block's nibbles: a
    non-finite pattern one time in 32, so in a 256-superblock tensor a refusal all but certainly (this file's
    bytes are fixed by its seed)."""
    path = tiny_gguf(tmp_path / "swap.gguf", "Q4_0", sizes=dict(layers=1))
    type_at, _ = tensor_info_fields(path, "blk.0.attn_output.weight", 2)
    patch(path, type_at, "I", int(GGMLQuantizationType.Q4_K))
    message = refused(path, weights="float")
    assert "'blk.0.attn_output.weight' (Q4_K) has a non-finite scale" in message


def test_a_type_swapped_for_a_larger_one_is_refused_as_overlapping_the_next_tensor(tmp_path):
    path = tiny_gguf(tmp_path / "larger.gguf", "Q4_0", sizes=dict(layers=1))
    type_at, _ = tensor_info_fields(path, "blk.0.attn_q.weight", 2)
    patch(path, type_at, "I", int(GGMLQuantizationType.Q8_0))  # 34 bytes a block for 18: reads into its neighbour
    message = refused(path)
    assert "'blk.0.attn_q.weight' (Q8_0" in message and "overlap" in message


def test_a_one_dimensional_tensor_of_a_block_type_is_refused(tmp_path):
    path = tiny_gguf(tmp_path / "norm-q.gguf", "Q8_0", sizes=dict(layers=1))
    type_at, _ = tensor_info_fields(path, "blk.0.attn_norm.weight", 1)
    patch(path, type_at, "I", int(GGMLQuantizationType.Q4_0))  # smaller: fits in the F32 norm's bytes
    message = refused(path)
    assert "'blk.0.attn_norm.weight' is Q4_0" in message and "1-D" in message


# -- files cut short ----------------------------------------------------------------------------------------------

# Runs in a child: Python cannot catch SIGBUS, so the parent checks the child lived. Each case loads a copy of
# the file: "static" cut to OFFSET before the load; "header" cut to OFFSET right after the header's version is
# parsed (as a copy being overwritten would be cut while the header is read); "data" cut after the header and
# tokenizer are read, as the tensors are about to be.
CUT_CHILD = r"""
import os, shutil, struct, sys
import torch
from engine.weights import gguf_file, loader
from engine.weights.loader import ModelLoadError, load_model, resolve_source

source, folder, cases = sys.argv[1], sys.argv[2], sys.argv[3:]
for number, case in enumerate(cases):
    mode, offset = case.split(":")[0], int(case.split(":")[1])
    path = os.path.join(folder, f"cut-{number}.gguf")
    with open(source, "rb") as src, open(path, "wb") as dst:
        shutil.copyfileobj(src, dst) if mode != "static" else dst.write(src.read(offset))
    restore = []
    if mode == "header":
        class CutAfterVersion:
            done = False
            def __getattr__(self, name):
                return getattr(struct, name)
            def unpack_from(self, fmt, buffer, at=0):
                if not self.done:
                    self.done = True
                    os.truncate(path, offset)
                return struct.unpack_from(fmt, buffer, at)
        restore.append((gguf_file, "struct", gguf_file.struct))
        gguf_file.struct = CutAfterVersion()
    if mode == "data":
        build = loader.load_gguf_model
        def cut_then_build(*args, **kwargs):
            os.truncate(path, offset)
            return build(*args, **kwargs)
        restore.append((loader, "load_gguf_model", build))
        loader.load_gguf_model = cut_then_build
    try:
        load_model(resolve_source(path), torch.device("cpu"), torch.float32, weights="int4")
        print(case, "LOADED", flush=True)
    except ModelLoadError as exc:
        print(case, "REFUSED", str(exc).replace("\n", " "), flush=True)
    for module, name, value in restore:
        setattr(module, name, value)
    os.remove(path)
"""


@pytest.mark.slow
def test_a_file_cut_short_before_or_while_loading_is_a_clear_error_not_a_crash(tmp_path):
    source = default_model_path()
    file = read_gguf(source)
    in_kv, in_infos = 1_000_000, (file.metadata_end + file.data_start) // 2
    in_data = file.tensors["blk.10.ffn_up.weight"].offset + 1000
    assert in_kv < file.metadata_end < in_infos < file.data_start < in_data  # where each cut lands
    cases = [f"static:{in_kv}", f"static:{in_infos}", f"static:{in_data}", f"header:{in_kv}",
             f"header:{in_infos}", f"data:{in_data}"]
    result = subprocess.run([sys.executable, "-c", CUT_CHILD, str(source), str(tmp_path), *cases],
                            capture_output=True, text=True, timeout=600,
                            env=child_env(KVBOOST_CACHE_DIR=str(tmp_path / "cache")))
    assert result.returncode == 0, f"child died with {result.returncode}: {result.stderr[-2000:]}"
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines() if line.split(" ")[0] in cases)
    assert sorted(lines) == sorted(cases), result.stdout
    for case in cases:
        assert lines[case].startswith("REFUSED"), (case, lines[case])
        assert "it may be incomplete or still being copied" in lines[case], (case, lines[case])
    for case in ("header:%d" % in_kv, "header:%d" % in_infos):
        assert f"the file ended at byte {case.split(':')[1]} while reading the header" in lines[case], lines[case]
    # tensors are read in the model's order, not the file's: the message names whichever past the cut comes first
    assert f"the file ended at byte {in_data} while reading tensor 'blk." in lines[f"data:{in_data}"]


def test_fp16_patterns_used_here_are_what_they_claim():
    values = np.array([NAN, INF, MINUS_INF], dtype=np.uint16).view(np.float16)
    assert np.isnan(values[0]) and values[1] == np.inf and values[2] == -np.inf
    assert struct.pack("<H", INF) == b"\x00\x7c"
