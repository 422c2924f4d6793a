"""`python -m bench` is the one entry to every benchmark, and `kvboost bench` reaches it without the engine
importing the bench package (the benchmarks themselves are run by hand, not by the suite)."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.__main__ import COMMANDS, main, usage

REPO = Path(__file__).resolve().parents[2]


def test_every_benchmark_with_a_main_is_a_command_and_every_command_has_a_main():
    with_main = set()
    for path in (REPO / "bench").glob("*.py"):
        tree = ast.parse(path.read_text())
        if path.stem != "__main__" and any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
            with_main.add(f"bench.{path.stem}")
    listed = {module for module, _ in COMMANDS.values()}
    assert with_main - {"bench.run"} == listed  # bench/run.py only puts the checkout on the path for `reuse`
    for module in listed:
        assert callable(importlib.import_module(module).main)


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    shown = capsys.readouterr().out
    assert shown == usage() + "\n"
    for name, (_, about) in COMMANDS.items():
        assert f"  {name}" in shown and about in shown


def test_an_unknown_command_is_an_error_that_lists_the_commands(capsys):
    assert main(["no-such-bench"]) == 2
    assert "unknown command 'no-such-bench'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, option", [(["decode", "--help"], "--head-groups"),  # bench.decode's own options
                                          (["gpu", "--help"], "--dry-run"),  # bench.gpu_check's
                                          (["kv-tiers", "--help"], "--help"),
                                          (["multiturn", "--help"], "WORKLOAD"),  # workloads: bench.reuse
                                          (["--help-me"], "unrecognized arguments")])  # bench.reuse's error
def test_commands_and_reuse_workloads_reach_their_module(argv, option, capsys):
    with pytest.raises(SystemExit) as done:  # argparse's --help (or its error) exits from the module's main
        main(argv)
    out = capsys.readouterr()
    assert option in out.out + out.err
    assert "commands:" not in out.out  # the module's own help, not the command table
    if argv[-1] == "--help":
        assert done.value.code == 0 and out.out.startswith("usage:")
    else:
        assert done.value.code == 2 and "kvboost bench" in out.err


def test_kvboost_bench_runs_the_bench_entry_in_a_child_process():
    code = "import sys; from cli.kvboost import main; sys.exit(main(['bench', '--help']))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == usage() + "\n"


@pytest.mark.skipif(sys.platform != "linux", reason="the probe is built with the system's cc and pthreads")
def test_the_kernels_bench_times_this_cpus_multiply_add_where_a_compiler_builds_its_probe():
    """`bench kernels --ceiling`: where the CPU has AVX-512 VNNI, the probe builds and reports a rate for each of
    its loops; elsewhere it says it cannot."""
    import shutil

    from bench.kernels import ceiling
    from engine.weights import gguf_blocks

    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler")
    found = ceiling(1, rounds=2_000_000)
    if "avx512_vnni" not in gguf_blocks.cpu_flags().split():
        assert found is None
        return
    assert found is not None, "the probe did not build"
    assert found.lanes == 16 and min(found[1:]) > 0
    # On AMD's Zen 4 (where the suite runs) the Q4_K mix's multiplies share the products' two pipes, ~20% more
    # work: a probe that lost its mix would time the products alone. Other CPUs' ports differ, so not asserted there.
    cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
    if "AuthenticAMD" in cpuinfo and "avx512_bf16" in gguf_blocks.cpu_flags().split():  # Zen 4 and later
        assert found.busd_q4k < 0.95 * found.busd


def test_the_kernels_bench_times_two_builds_side_by_side():
    """`bench kernels --against LIBRARY`: this build's products and another build's, calls alternating, both
    computed (here the other build is this one, loaded a second time: the same outputs, times for each)."""
    from bench.kernels import side_by_side
    from engine.weights import gguf_blocks

    if gguf_blocks.cannot_build():  # no compiler and no shipped build here; a build that fails still fails this
        pytest.skip(gguf_blocks.cannot_build())
    rows = side_by_side([1, 8], calls=2, copies=2, other=gguf_blocks.library()._name)
    assert [r["rows"] for r in rows] == [1, 8]
    assert all(r["this"] > 0 and r["other"] > 0 and r["apart"] == 0.0 for r in rows)  # the same build: same bits
    # and attention, the two builds' calls alternating, their outputs compared bit for bit
    from bench.kernels import attention

    found = attention([1, 4], context=40, calls=2, threads=1, other=gguf_blocks.library()._name, past_caches=False)
    assert [a["positions"] for a in found] == [1, 4]
    assert all(a["us"] > 0 and a["other"] > 0 and a["same"] is True for a in found)


def test_the_kernels_bench_times_requests_that_begin_alike_with_the_same_bits_either_way():
    """`bench kernels --requests N`: a batched step's attention for requests whose beginnings are alike, each
    reading its own copy and all reading the first one's: both timed, the outputs the same bits."""
    from bench.kernels import shared_beginnings
    from engine.weights import gguf_blocks

    if gguf_blocks.cannot_build():  # no compiler and no shipped build here; a build that fails still fails this
        pytest.skip(gguf_blocks.cannot_build())
    found = shared_beginnings(3, context=70, calls=2, threads=1)
    assert found["own"] > 0 and found["one"] > 0 and found["same"] is True


def test_the_rounding_benchmark_rounds_each_run_of_32_to_its_codes_ties_to_even():
    from bench.rounding import rounded

    run = torch.tensor([127.0, 2.5, 3.5, -2.5, 0.5, -0.5, 1.5, -126.6] + [0.25] * 24)  # max 127: a step of 1
    x = torch.stack([run, torch.zeros(32), run * 2]).reshape(1, 3, 32)
    got = rounded(x, 127.0)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert got[0, 0, :8].tolist() == [127.0, 2.0, 4.0, -2.0, 0.0, -0.0, 2.0, -127.0]
    assert got[0, 0, 8:].abs().sum() == 0  # 0.25 of a step rounds to 0
    assert got[0, 1].abs().sum() == 0  # an all-zero run stays zero (no division by a zero scale)
    assert torch.equal(got[0, 2], got[0, 0] * 2)  # each run its own scale
    wide = torch.arange(64, dtype=torch.float32).reshape(1, 64) / 7
    fine = rounded(wide, 32767.0)
    assert torch.equal(fine[0, :32].max(), wide[0, :32].max()) and (fine - wide).abs().max() < 2e-4


def engine_timing_is_off(engine) -> bool:
    """No phase of a forward is timed once ForwardTimes has left: a forward leaves the C call's sums as they were."""
    import ctypes

    from engine.weights import gguf_blocks

    library, sums = gguf_blocks.library(), (ctypes.c_double * 4)()
    library.kvb_forward_phases(sums)
    before = tuple(sums)
    engine.generate(engine.encode([{"role": "user", "content": "Hi"}]), max_new_tokens=2, temperature=0.0)
    library.kvb_forward_phases(sums)
    return tuple(sums) == before


def test_the_batching_bench_times_each_forward_pass_by_its_requests_and_unwraps_after(smollm):
    """`bench batching --by-step`: passes of one request alone (ModelRunner.forward) and of several together
    (Batch._answer) are each timed once, by their requests and tokens, with the parts of each (the layers' one C
    call, the head); leaving puts the engine's methods back."""
    from bench.batching import ForwardTimes
    from engine import EngineWorker, Result
    from engine.batching import Batch
    from engine.block_forward import OneCallForward
    from engine.runner import ModelRunner
    from engine.weights.gguf_blocks import BlockLinear

    engine = smollm.with_options(reuse="off", speculative=None)
    prompts = [engine.encode([{"role": "user", "content": q}]) for q in ("Name a colour.", "Name a fruit.")]
    originals = Batch._answer, ModelRunner.forward, OneCallForward._layers_over, BlockLinear.forward
    with ForwardTimes() as timed:
        alone = engine.generate(prompts[0], max_new_tokens=4, temperature=0.0)
        worker = EngineWorker(name="test-by-step", max_batch=2)
        jobs = [worker.submit(lambda cancel, p=p: engine.stream(p, cancel=cancel, max_new_tokens=4, temperature=0.0))
                for p in prompts]
        together = [next(e for e in job if isinstance(e, Result)) for job in jobs]
        assert worker.stop(5)
    assert (Batch._answer, ModelRunner.forward, OneCallForward._layers_over, BlockLinear.forward) == originals
    assert together[0].text == alone.text
    decoding = [(p.requests, p.tokens) for p in timed.passes if not p.prompt]
    assert decoding.count((1, 1)) >= len(alone.token_ids) - 1  # alone: a pass a token after the first
    assert (2, 2) in decoding  # both requests' next tokens in one pass
    for p in timed.passes:  # every pass: its layers in one C call, taken apart there; its head from Python
        assert 0 < p.layers and 0 < p.linears and p.layers + p.linears < p.seconds
        assert len(p.phases) == 4 and all(0 < phase for phase in p.phases) and sum(p.phases) < p.layers
    assert engine_timing_is_off(smollm)
    rows = {line.split("|")[1].strip() for line in timed.table()[2:]}
    assert {"1", "2"} <= rows
