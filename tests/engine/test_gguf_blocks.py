"""The GGUF block kernel (engine.weights.gguf_blocks, engine/weights/gguf_blocks.c) against independent references:
gguf-py's dequantization, float64 products of those values, its own activation rounding checked from its definition, and
the same outputs however many rows are multiplied together. Also what happens where it cannot be built."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from engine.weights import gguf_blocks
from engine.weights.gguf_blocks import BLOCK_TYPES, BlockEmbedding, BlockLinear

pytestmark = pytest.mark.skipif(gguf_blocks.unavailable() is not None,
                                reason=f"block kernel unavailable: {gguf_blocks.unavailable()}")
TYPES = tuple(BLOCK_TYPES)
SCALE_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}
ROOT = Path(__file__).resolve().parents[2]


def random_rows(type_name: str, rows: int, columns: int, seed: int = 0) -> np.ndarray:
    """Stored bytes of a [rows, columns] tensor: random codes and sub-scales, small positive fp16 scales."""
    rng = np.random.default_rng(seed)
    _, per_block, block_bytes = BLOCK_TYPES[type_name]
    data = rng.integers(0, 256, (rows, columns // per_block, block_bytes), dtype=np.uint8)
    for offset in SCALE_FIELDS[type_name]:
        scales = rng.uniform(1e-3, 2e-2, data.shape[:2]).astype(np.float16)
        data[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(*data.shape[:2], 2)
    return data.reshape(rows, -1)


def reference_weight(data: np.ndarray, type_name: str) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf_dequantize(data, GGMLQuantizationType[type_name])))


def rebuilt_activations(x: torch.Tensor, block: int) -> torch.Tensor:
    """What the kernel multiplies by: its integer codes times their block's scale, in float64."""
    q, d, _ = gguf_blocks.quantize_activations(x, block)
    return (q.double().reshape(x.shape[0], -1, block) * d.double()[:, :, None]).reshape(x.shape)


@pytest.mark.parametrize("type_name", TYPES)
def test_rows_read_back_are_gguf_pys_dequantized_values_bit_for_bit(type_name):
    data = random_rows(type_name, 40, 512)
    ours = gguf_blocks.dequantize(torch.from_numpy(data.copy()), type_name, 512)
    assert torch.equal(ours, reference_weight(data, type_name))
    some = torch.tensor([39, 0, 7, 7])
    assert torch.equal(gguf_blocks.dequantize(torch.from_numpy(data.copy()), type_name, 512, some),
                       reference_weight(data, type_name)[some])


@pytest.mark.parametrize("block,top,dtype", [(32, 32767, torch.int16), (256, 127, torch.int8)])
def test_activations_round_to_the_nearest_step_of_their_blocks_largest_value(block, top, dtype):
    """int16 per 32 for the 32-value types, int8 per 256 (llama.cpp's rounding) for the K-quants."""
    x = torch.randn(5, 1024) * torch.logspace(-3, 2, 1024)  # blocks of very different sizes
    x[2, :block] = 0  # an all-zero block: scale 0, codes 0
    x[3, block + 4] = 1e4  # the block's largest value, then a NaN 16 values on (one vector lane): passed over
    x[3, block + 20] = float("nan")
    q, d, sums = gguf_blocks.quantize_activations(x.contiguous(), block)
    blocks = x.reshape(5, -1, block)
    want_d = blocks.abs().nan_to_num(0.0).amax(-1) / top
    assert q.dtype == dtype and torch.equal(d, want_d)
    assert int(q.abs().max()) <= top and d[2, 0] == 0 and not q[2, :block].any()
    error = (blocks.double() - q.double().reshape(5, -1, block) * d.double()[:, :, None]).abs().nan_to_num(0.0)
    assert torch.all(error <= d.double()[:, :, None] * (0.5 + top * 2**-23))  # and x / d's float32 rounding
    group = 32 if block == 32 else 16
    code_sums = sums[..., 0] if block == 32 else sums
    assert torch.equal(code_sums.to(torch.int64), q.to(torch.int64).reshape(5, -1, group).sum(-1))
    if block == 32:  # beside each sum, the block's scale times it, rounded to float32 once (Q4_1's offsets)
        assert torch.equal(sums[..., 1].contiguous().view(torch.float32), d * code_sums.to(torch.float32))


def test_int16_codes_are_each_value_times_the_inverse_step_rounded_half_to_even():
    """The 32-value types' rounding, value by value against float32 numpy: x * (1 / (max / 32767)) to the nearest
    integer, ties to even, as int16 (a NaN: 0); each block's code sum, and the scale times it rounded once."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((7, 96)) * np.logspace(-4, 3, 96)).astype(np.float32)
    x[1, :32] = [32767.0, 2.5, 3.5, -2.5, 0.5, -0.5, 1.5, -1.5] + [0.25] * 24  # step 1: ties go to the even code
    x[2, 32:64] = 0.0
    x[3, 40], x[3, 41] = np.inf, np.nan
    x[4, 64:96] = -7.0
    q, d, sums = gguf_blocks.quantize_activations(torch.from_numpy(x), 32)
    blocks = x.reshape(7, 3, 32)
    amax = np.nanmax(np.abs(blocks), axis=-1).astype(np.float32)
    scale = (amax / np.float32(32767)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        inverse = np.where(scale > 0, np.float32(1) / scale, np.float32(0)).astype(np.float32)
        product = blocks * inverse[..., None]
    codes = np.where(np.isnan(product), 0, np.rint(np.nan_to_num(product)))
    codes = ((codes.astype(np.int64) + 32768) % 65536 - 32768).reshape(7, 96)
    assert torch.equal(d, torch.from_numpy(scale)) and torch.equal(q.to(torch.int64), torch.from_numpy(codes))
    assert q[1, :8].tolist() == [32767, 2, 4, -2, 0, 0, 2, -2]
    code_sums = codes.reshape(7, 3, 32).sum(-1)
    assert torch.equal(sums[..., 0].to(torch.int64), torch.from_numpy(code_sums))
    with np.errstate(invalid="ignore"):  # the block holding inf: scale inf times its sum
        scaled = (scale * code_sums.astype(np.float32)).astype(np.float32)
    torch.testing.assert_close(sums[..., 1].contiguous().view(torch.float32), torch.from_numpy(scaled), rtol=0,
                               atol=0, equal_nan=True)


@pytest.mark.parametrize("type_name", TYPES)
def test_a_product_is_the_float64_product_of_the_files_values_and_the_rounded_activations(type_name):
    data = random_rows(type_name, 96, 768, seed=1)
    x = torch.randn(6, 768)
    got = gguf_blocks.matmul(torch.from_numpy(data.copy()), type_name, 768, x).double()
    weight = reference_weight(data, type_name).double()
    exact = rebuilt_activations(x, gguf_blocks.activation_block(type_name)) @ weight.T
    assert (got - exact).abs().max() <= 2e-6 * exact.abs().max()  # float32 sums over 24-ish blocks
    # against the unrounded activations: the activation rounding alone (half a step of 1/127 of a block's max for
    # the K-quants, of 1/32767 for the others)
    true = x.double() @ weight.T
    assert (got - true).norm() <= (0.02 if type_name.endswith("_K") else 1e-4) * true.norm()


@pytest.mark.parametrize("type_name", TYPES)
def test_an_output_is_the_same_whatever_rows_and_threads_it_is_computed_with(type_name):
    blocks = torch.from_numpy(random_rows(type_name, 50, 512, seed=2))
    x = torch.randn(19, 512)  # taken 8 + 8 + 2 + 1 rows at a time; split below into 4 + 2 + 1 and 8 + 4
    together = gguf_blocks.matmul(blocks, type_name, 512, x)
    alone = torch.cat([gguf_blocks.matmul(blocks, type_name, 512, x[i:i + 1].contiguous()) for i in range(19)])
    # weight rows 0-47 in 16-row tiles where the type has them, 48-49 one at a time; each row alone: one at a time
    column_by_column = torch.cat([gguf_blocks.matmul(blocks[c:c + 1].contiguous(), type_name, 512, x)
                                  for c in range(50)], dim=1)
    split = torch.cat([gguf_blocks.matmul(blocks, type_name, 512, x[:7].contiguous()),
                       gguf_blocks.matmul(blocks, type_name, 512, x[7:].contiguous())])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one_thread = gguf_blocks.matmul(blocks, type_name, 512, x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, alone) and torch.equal(together, split) and torch.equal(together, one_thread)
    assert torch.equal(together, column_by_column)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q4_1"])
def test_a_weight_taken_in_several_cache_sized_chunks_gives_each_output_its_own_tiles_result(type_name):
    """A product over many rows takes a thread's weight rows ~256 KB at a time (gguf_blocks.c, CHUNK_BYTES): with
    4096 columns a chunk is 6-7 tasks of 16 rows, so 384 rows on two threads make two chunks each. Every output is
    the one its 16 weight rows give alone (no chunks) and the float64 product's to float32 rounding."""
    data = random_rows(type_name, 384, 4096, seed=8)
    blocks = torch.from_numpy(data.copy())
    tiles = gguf_blocks.as_tiles(blocks, type_name, 4096)
    weight, tiled = (blocks, False) if tiles is None else (tiles, True)
    x = torch.randn(21, 4096)  # 8 + 8 + 5 rows at a time
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        together = gguf_blocks.matmul(weight, type_name, 4096, x, tiled=tiled)
    finally:
        torch.set_num_threads(threads)
    by_task = torch.cat([gguf_blocks.matmul(weight[16 * t:16 * t + 16].contiguous(), type_name, 4096, x, tiled=tiled)
                         for t in range(24)], dim=1)
    assert torch.equal(together, by_task)
    weight64 = reference_weight(data, type_name).double()
    exact = rebuilt_activations(x, gguf_blocks.activation_block(type_name)) @ weight64.T
    assert (together.double() - exact).abs().max() <= 2e-6 * exact.abs().max()


def test_the_c_entry_multiplies_rows_of_no_columns_without_dividing_by_zero():
    """kvb_matmul cuts a thread's tasks into chunks by their bytes; a weight of no columns (rows of 0 bytes, which
    the Python side refuses before it gets here) must give zeros, not a division by zero."""
    w, y = torch.zeros(64, dtype=torch.uint8), torch.full((1, 16), 7.0)
    q, d, sums = torch.zeros(64, dtype=torch.int8), torch.zeros(4), torch.zeros(64, dtype=torch.int16)
    status = gguf_blocks._library().kvb_matmul(BLOCK_TYPES["Q4_K"][0], w.data_ptr(), 16, 0, 0, q.data_ptr(),
                                               d.data_ptr(), sums.data_ptr(), 1, y.data_ptr(), 1)
    assert status == 0 and not y.any()


@pytest.mark.parametrize("type_name", TYPES)
def test_weights_held_as_tiles_read_back_and_multiply_as_their_rows(type_name):
    """Where the CPU multiplies 16-row tiles (the 32-value types with AVX2 or AVX-512, Q4_K with AVX-512 VNNI), a
    layer holds its weight in their order: the same bytes, the same values read back, the same outputs bit for
    bit for any number of activation rows."""
    if not gguf_blocks.tiles(type_name):
        pytest.skip(f"this CPU's build has no tiles for {type_name}")
    data = torch.from_numpy(random_rows(type_name, 48, 512, seed=5))
    tiles = gguf_blocks.as_tiles(data, type_name, 512)
    assert tiles.shape == data.shape and not torch.equal(tiles, data)
    handed = data.clone()  # reordered where it lies: the same tiles, no second copy
    assert gguf_blocks.as_tiles(handed, type_name, 512, in_place=True).data_ptr() == handed.data_ptr()
    assert torch.equal(handed, tiles)
    assert torch.equal(gguf_blocks.dequantize(tiles, type_name, 512, tiled=True),
                       gguf_blocks.dequantize(data, type_name, 512))
    rows = torch.tensor([0, 17, 47, 5, 31])
    assert torch.equal(gguf_blocks.dequantize(tiles, type_name, 512, rows, tiled=True),
                       gguf_blocks.dequantize(data, type_name, 512, rows))
    for m in (1, 2, 3, 5, 6, 7, 8, 13, 70):  # 13: 8 rows, then 5 in one pass where the type has it
        x = torch.randn(m, 512)
        assert torch.equal(gguf_blocks.matmul(tiles, type_name, 512, x, tiled=True),
                           gguf_blocks.matmul(data, type_name, 512, x)), m
    layer = BlockLinear(data, type_name, 512)
    assert layer.tiled and torch.equal(layer.dequantize(), gguf_blocks.dequantize(data, type_name, 512))
    assert gguf_blocks.as_tiles(data[:40].contiguous(), type_name, 512) is None  # not whole tiles: rows stay
    with pytest.raises(ValueError, match="cannot be tiles"):
        gguf_blocks.matmul(data[:40].contiguous(), type_name, 512, torch.randn(1, 512), tiled=True)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_amx_gives_each_row_what_the_vector_tiles_give(type_name):
    """Where AMX takes 16 activation rows at a time, a prefill's rows are those one row at a time gives, bit for
    bit (the integer dots are exact, the scaling and float steps the same)."""
    if not (gguf_blocks.tiles(type_name) and gguf_blocks.amx()):
        pytest.skip(f"no AMX for {type_name} tiles here")
    tiles = gguf_blocks.as_tiles(torch.from_numpy(random_rows(type_name, 64, 768, seed=7)), type_name, 768)
    x = torch.randn(80, 768) * torch.logspace(-2, 2, 768)  # activations of very different sizes per column
    together = gguf_blocks.matmul(tiles, type_name, 768, x, tiled=True)
    one_by_one = torch.cat([gguf_blocks.matmul(tiles, type_name, 768, x[i:i + 1].contiguous(), tiled=True)
                            for i in range(80)])
    assert torch.equal(together, one_by_one)


def test_a_layer_and_a_table_over_the_same_blocks():
    data = random_rows("Q6_K", 64, 256, seed=3)
    weight = reference_weight(data, "Q6_K")
    bias = torch.randn(64)
    layer = BlockLinear(torch.from_numpy(data.copy()), "Q6_K", 256, bias)
    x = torch.randn(2, 3, 256, dtype=torch.bfloat16)
    y = layer(x)
    assert y.shape == (2, 3, 64) and y.dtype == torch.bfloat16
    want = x.double() @ weight.double().T + bias.double()
    assert (y.double() - want).norm() <= 0.03 * want.norm()
    table = BlockEmbedding(layer.blocks, "Q6_K", 256, torch.float32, embed_scale=torch.tensor(2.0), tiled=layer.tiled)
    ids = torch.tensor([[3, 63], [0, 3]])
    assert torch.equal(table(ids), weight[ids] * 2.0)
    assert torch.equal(layer.dequantize(), weight)


def test_shapes_that_are_not_whole_blocks_and_rows_out_of_range_are_refused():
    data = torch.from_numpy(random_rows("Q4_K", 4, 512))
    with pytest.raises(ValueError, match="not rows of 256"):
        BlockLinear(data, "Q4_K", 256)
    with pytest.raises(ValueError, match="not whole blocks"):
        gguf_blocks.row_bytes("Q4_K", 300)
    with pytest.raises(ValueError, match="does not hold Q5_K"):
        gguf_blocks.row_bytes("Q5_K", 256)
    with pytest.raises(ValueError, match="not contiguous float32 rows of 512"):
        gguf_blocks.matmul(data, "Q4_K", 512, torch.randn(2, 256))
    with pytest.raises(ValueError, match="256 features into a layer of 512"):
        BlockLinear(data, "Q4_K", 512)(torch.randn(4, 256))
    table = BlockEmbedding(data, "Q4_K", 512, torch.float32)
    with pytest.raises(IndexError):
        table(torch.tensor([4]))
    with pytest.raises(IndexError):
        table(torch.tensor([-1]))


CHILD = r"""
import json, os, sys, numpy as np, torch
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from engine.weights import gguf_blocks
if os.environ.get("TEST_PREBUILT"):  # before anything asks for the kernel
    gguf_blocks.PREBUILT = Path(os.environ["TEST_PREBUILT"])
from test_gguf_blocks import random_rows, reference_weight, rebuilt_activations
out = {"unavailable": gguf_blocks.unavailable()}
if out["unavailable"] is None:
    out["path"], out["numerics"] = gguf_blocks.vector_path(), gguf_blocks.numerics()
    errors = {}
    for name in gguf_blocks.BLOCK_TYPES:
        data = random_rows(name, 32, 512, seed=4)
        x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
        got = gguf_blocks.matmul(torch.from_numpy(data.copy()), name, 512, x).double()
        exact = rebuilt_activations(x, gguf_blocks.activation_block(name)) @ reference_weight(data, name).double().T
        errors[name] = float((got - exact).abs().max() / exact.abs().max())
        out.setdefault("outputs", {})[name] = got.float().tolist()  # every path's float steps are the same
        tiles = gguf_blocks.as_tiles(torch.from_numpy(data.copy()), name, 512)
        if tiles is not None:
            out.setdefault("tiled", {})[name] = gguf_blocks.matmul(tiles, name, 512, x, tiled=True).tolist()
    out["errors"] = errors
elif len(sys.argv) > 2:  # a GGUF load where the kernel cannot be built
    from engine.weights.loader import load_model, resolve_source
    source = resolve_source(sys.argv[2])
    model, _ = load_model(source, torch.device("cpu"), torch.float32, weights="int4")
    out["layers"] = sorted({type(m).__name__ for n, m in model.named_modules() if n.endswith("q_proj")})
    try:
        load_model(source, torch.device("cpu"), torch.float32, weights="int4", kernel="gguf_blocks")
    except ValueError as exc:
        out["asked"] = str(exc)
print(json.dumps(out))
"""


def child(tmp_path, *args, **env) -> dict:
    environment = {**os.environ, "KVBOOST_CACHE_DIR": str(tmp_path), **env}
    done = subprocess.run([sys.executable, "-c", CHILD, str(Path(__file__).parent), *args], cwd=ROOT,
                          env=environment, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_portable_c_path_computes_the_same_products(tmp_path):
    """Built for a CPU without AVX2 (another machine's build, or not x86): the same integer sums."""
    result = child(tmp_path, KVBOOST_BLOCKS_MARCH="x86-64" if os.uname().machine == "x86_64" else "native")
    assert result["unavailable"] is None
    if os.uname().machine == "x86_64":
        assert result["path"] == "portable C"
        # the same float steps as the vector paths': the same numerics in the fingerprint
        assert result["numerics"] == gguf_blocks.numerics()
    assert max(result["errors"].values()) <= 2e-6, result


def this_builds_outputs() -> dict:
    outputs = {}
    for name in gguf_blocks.BLOCK_TYPES:
        data = random_rows(name, 32, 512, seed=4)
        x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
        outputs[name] = gguf_blocks.matmul(torch.from_numpy(data.copy()), name, 512, x)
    return outputs


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="builds for other x86 CPUs")
@pytest.mark.parametrize("march", ["x86-64", "haswell"])
def test_every_type_gives_the_same_bits_on_every_path(tmp_path, march):
    """Portable C, AVX2 one weight row at a time and the 16-row tiles (AVX2's and AVX-512's) take the same float
    steps for every type, the K-quants included, so a build for another CPU gives the same outputs (KV stored by
    one is the KV another computes)."""
    result = child(tmp_path, KVBOOST_BLOCKS_MARCH=march)
    assert result["path"] == ("portable C" if march == "x86-64" else "avx2")
    assert ("tiled" in result) == (march != "x86-64")  # AVX2 multiplies tiles too, portable C rows only
    for name, got in this_builds_outputs().items():
        assert torch.equal(torch.tensor(result["outputs"][name]), got), name
        if name in result.get("tiled", {}):
            assert torch.equal(torch.tensor(result["tiled"][name]), got), name
    if gguf_blocks.tiles("Q4_K"):  # this build's K-quant tiles against another build's rows
        data = torch.from_numpy(random_rows("Q4_K", 32, 512, seed=4))
        x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
        tiled = gguf_blocks.matmul(gguf_blocks.as_tiles(data, "Q4_K", 512), "Q4_K", 512, x, tiled=True)
        assert torch.equal(torch.tensor(result["outputs"]["Q4_K"]), tiled)


def test_without_a_compiler_the_kernel_says_why_and_loaders_keep_torchs_kernels(tmp_path):
    from gguf_files import tiny_gguf

    path = tiny_gguf(tmp_path / "q4k.gguf", "Q4_K")
    result = child(tmp_path, str(path), CC=str(tmp_path / "no-such-cc"), PATH=str(tmp_path))
    assert "no C compiler" in result["unavailable"]
    assert result["layers"] == ["Int4Linear"]
    assert "'gguf_blocks' is unavailable: no C compiler" in result["asked"]


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the shipped build is for x86-64-v3")
def test_without_a_compiler_the_build_shipped_with_the_installers_runs(tmp_path):
    import shutil

    prebuilt = tmp_path / gguf_blocks.PREBUILT.name
    built = subprocess.run(gguf_blocks.build_command(shutil.which("cc") or "gcc", prebuilt, "x86-64-v3"),
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    result = child(tmp_path, CC=str(tmp_path / "no-such-cc"), PATH=str(tmp_path), TEST_PREBUILT=str(prebuilt))
    if not set(gguf_blocks._cpu_flags().split()) >= set(gguf_blocks.PREBUILT_NEEDS):
        assert "no C compiler" in result["unavailable"]  # a CPU the shipped build cannot run on
        return
    assert result["unavailable"] is None and result["path"] == "avx2"
    assert max(result["errors"].values()) <= 2e-6, result


POOL_CHILD = r"""
import os, threading, torch
torch.set_num_threads(2)
from engine.weights import gguf_blocks
x = torch.randn(8, 256)
def tasks():
    return len(os.listdir("/proc/self/task"))
gguf_blocks.quantize_activations(x, 32)  # the loading thread's call: the kernels' threads start here
seen = {}
def worker():
    before = tasks()
    for _ in range(3):
        gguf_blocks.quantize_activations(x, 32)
    seen["started"] = tasks() - before
thread = threading.Thread(target=worker)
thread.start()
thread.join()
print("threads started by a second caller:", seen["started"])
pid = os.fork()
if pid == 0:  # a forked child has none of the parent's threads; its calls must still run
    q = gguf_blocks.quantize_activations(x, 32)[0]
    os._exit(0 if q.shape == x.shape else 1)
print("forked child:", os.waitpid(pid, 0)[1])
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc")
def test_every_thread_shares_one_set_of_kernel_threads_and_a_forked_child_still_computes():
    """The kernels' threads belong to the process, not to the calling thread: the engine's worker thread, calling
    after the loading thread did, starts none of its own (with a set per caller, the two sets outnumbered the
    cores and every parallel loop of a decode step woke its threads through the kernel: 3x slower steps), and a
    child forked after the threads started (document workers) computes instead of waiting on threads it lacks."""
    done = subprocess.run([sys.executable, "-c", POOL_CHILD], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "threads started by a second caller: 0" in done.stdout, done.stdout
    assert "forked child: 0" in done.stdout, done.stdout
