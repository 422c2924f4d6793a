"""`python -m bench kernels`: the C kernels alone, by the number of rows computed at once: what a check of drafted
tokens or a batch of streams costs against one token, before any Python.

- The block kernel's product for 1-8 activation rows (a speculative check's positions, a batch's streams): one
  Q4_1 weight of the embedded model's MLP shape (1536 x 576) held as tiles, as the engine holds it, multiplied by
  R rows; the weight rotates between enough copies to miss the caches, as a decode step's weights do. Per R: the
  median microseconds, GMAC/s, and the cost against one row. `--type Q4_K` / `Q6_K`: a weight of the 1.5B shape's
  MLP in that type instead (8960 x 1536 as the gate's, 1536 x 8960 as the down projection's).
- With `--against LIBRARY`, the same products side by side with another build of the kernel (another checkout's
  library), calls alternating in one process, their outputs compared: a kernel change timed against the build
  before it. Equal bits, or, where a change moved the float steps (gguf_blocks.numerics), the largest difference
  printed; one past float32 rounding stops the run.
- Row attention for a decode step (1 position) and checks (4, 5, 9 positions) at a given context, the embedded
  model's heads (9 query heads, 3 kv heads of 64): the median microseconds of one layer's call over a cache's
  buffer, its keys and values rotated past L3 as a decode step finds them, and the cost against one position; with
  `--against`, side by side with the other build, the outputs compared bit for bit.
- With `--requests N`: a batched step's attention for N requests whose first cached tokens (the first `--context`)
  are alike, each reading its own copy against all reading the first one's (engine/block_forward.py's leads).

Medians of alternating calls (the machine's noise hits every row alike); the threads are the engine's
(`--threads`). The numbers compare row counts within one run: a row that costs 2x one row makes a check of that
many positions cost about that much more in the layers.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np
import torch

from engine.weights import gguf_blocks

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
# per type: (rows, columns, values a block, bytes a block, where the block's fp16 scales are): the embedded model's
# MLP for Q4_1, the 1.5B shape's for the K-quants (Q4_K as its gate, Q6_K as its down projection)
SHAPES = {"Q4_1": (1536, 576, 32, 20, (0, 2)), "Q4_K": (8960, 1536, 256, 144, (0, 2)),
          "Q6_K": (1536, 8960, 256, 210, (208,))}
PAST_CACHES = 110 * 2 ** 20  # bytes of weight copies rotated by default: past this machine's L3


def random_weight(kind: str, seed: int) -> torch.Tensor:
    """The stored bytes of a random weight of SHAPES[kind], as tiles where this build has them: random codes (and
    sub-block scales), small positive fp16 scales."""
    out, columns, values, size, scales = SHAPES[kind]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (out, columns // values, size), dtype=np.uint8)
    for offset in scales:
        scale = rng.uniform(1e-3, 2e-2, data.shape[:2]).astype(np.float16)
        data[:, :, offset:offset + 2] = scale.view(np.uint8).reshape(*data.shape[:2], 2)
    blocks = torch.from_numpy(data.reshape(out, -1))
    tiles = gguf_blocks.as_tiles(blocks, kind, columns)
    return blocks if tiles is None else tiles


def default_copies(kind: str) -> int:
    out, columns, values, size, _ = SHAPES[kind]
    return max(2, -(-PAST_CACHES // (out * columns // values * size)))


def products(rows: Sequence[int], calls: int, copies: int, kind: str = "Q4_1") -> list[dict]:
    """Per row count: median us of one product, GMAC/s, and the cost against one row."""
    out_features, columns = SHAPES[kind][:2]
    tiled = gguf_blocks.tiles(kind)
    weights = [random_weight(kind, seed) for seed in range(copies)]
    inputs = {r: torch.randn(r, columns) for r in rows}
    spent: dict[int, list[float]] = {r: [] for r in rows}
    for call in range(calls):
        for r in rows:
            weight = weights[(call * len(rows) + r) % copies]
            start = time.perf_counter()
            gguf_blocks.matmul(weight, kind, columns, inputs[r], tiled=tiled)
            spent[r].append(time.perf_counter() - start)
    one = statistics.median(spent[rows[0]]) if rows[0] == 1 else None
    out = []
    for r in rows:
        seconds = statistics.median(spent[r])
        out.append({"rows": r, "us": 1e6 * seconds, "gmacs": r * out_features * columns / seconds / 1e9,
                    "cost": seconds / one if one else float("nan")})
    return out


def side_by_side(rows: Sequence[int], calls: int, copies: int, other: str, kind: str = "Q4_1") -> list[dict]:
    """Per row count: median us of one product with this checkout's build and with `other` (another build's
    library), calls alternating in one process (the machine's noise hits both alike), and the largest difference
    between the two builds' outputs relative to the largest output (0.0: the same bits). SystemExit where it is
    past float32 rounding over a row's blocks: not the same product."""
    theirs, ours = gguf_blocks.other_build(other), gguf_blocks.library()
    columns = SHAPES[kind][1]
    tiled = gguf_blocks.tiles(kind)
    weights = {}  # each build's tiles in its own layout, of the same bytes
    for lib in (ours, theirs):
        with gguf_blocks.build_in_use(lib):
            weights[id(lib)] = [random_weight(kind, seed) for seed in range(copies)]
    inputs = {r: torch.randn(r, columns) for r in rows}
    spent: dict[tuple[str, int], list[float]] = {(name, r): [] for name in ("this", "other") for r in rows}
    for call in range(calls):
        order = [("this", ours), ("other", theirs)]
        for name, lib in order if call % 2 == 0 else order[::-1]:
            with gguf_blocks.build_in_use(lib):
                for r in rows:
                    weight = weights[id(lib)][(call * len(rows) + r) % copies]
                    start = time.perf_counter()
                    gguf_blocks.matmul(weight, kind, columns, inputs[r], tiled=tiled)
                    spent[(name, r)].append(time.perf_counter() - start)
    apart = {}
    for r in rows:
        outputs = []
        for lib in (ours, theirs):
            with gguf_blocks.build_in_use(lib):
                outputs.append(gguf_blocks.matmul(weights[id(lib)][0], kind, columns, inputs[r], tiled=tiled))
        apart[r] = float((outputs[0] - outputs[1]).abs().max() / outputs[1].abs().max())
        if not apart[r] <= 1e-5:  # a float32 sum over 18 blocks: a few 2^-24 of its largest term
            raise SystemExit(f"bench kernels: the two builds' products of {r} rows differ by {apart[r]:.2e}")
    return [{"rows": r, "this": 1e6 * statistics.median(spent[("this", r)]),
             "other": 1e6 * statistics.median(spent[("other", r)]), "apart": apart[r]} for r in rows]


def attention(positions: Sequence[int], context: int, calls: int, threads: int, other: str | None = None,
              past_caches: bool = True) -> list[dict]:
    """Per number of positions: median us of one layer's row attention over `context` cached keys (a cache's
    buffer with room to spare, as the one-call forward hands it), and the cost against one position. The keys and
    values rotate between enough buffers to miss the caches, as a decode step finds them (the step's weights have
    pushed them out; `past_caches=False`: one buffer, in cache). With `other` (another build's library), its calls
    alternate with this build's, over the same buffers, and each output is compared bit for bit."""
    libs = {"this": gguf_blocks.library()}
    if other:
        libs["other"] = gguf_blocks.other_build(other)
    room = context + max(positions) + 64
    layer_bytes = 2 * KV_HEADS * room * HEAD_DIM * 4
    copies = max(2, PAST_CACHES // layer_bytes) if past_caches else 1
    keys = [torch.randn(KV_HEADS, room, HEAD_DIM) for _ in range(copies)]
    values = [torch.randn(KV_HEADS, room, HEAD_DIM) for _ in range(copies)]
    queries = {n: torch.randn(HEADS, n, HEAD_DIM) for n in positions}
    spent: dict[tuple[str, int], list[float]] = {(name, n): [] for name in libs for n in positions}

    def attend(lib, n: int, at: int) -> tuple[torch.Tensor, float]:
        out = torch.empty(n, HEADS, HEAD_DIM)
        start = time.perf_counter()
        status = lib.kvb_attention(queries[n].data_ptr(), keys[at].data_ptr(), values[at].data_ptr(), 0,
                                   room * HEAD_DIM, None, 1, 1, out.data_ptr(), 1, HEADS, KV_HEADS, n, context + n,
                                   HEAD_DIM, ctypes.c_float(HEAD_DIM ** -0.5), threads)
        seconds = time.perf_counter() - start
        if status != 0:
            raise MemoryError("no scratch memory for attention")
        return out, seconds

    turn = 0
    for call in range(calls):
        for name, lib in list(libs.items())[:: 1 if call % 2 == 0 else -1]:
            for n in positions:
                spent[(name, n)].append(attend(lib, n, turn % copies)[1])
                turn += 1
    one = statistics.median(spent[("this", positions[0])])
    rows = []
    for n in positions:
        row = {"positions": n, "us": 1e6 * statistics.median(spent[("this", n)]),
               "cost": statistics.median(spent[("this", n)]) / one}
        if other:
            row["other"] = 1e6 * statistics.median(spent[("other", n)])
            row["same"] = torch.equal(attend(libs["this"], n, 0)[0], attend(libs["other"], n, 0)[0])
        rows.append(row)
    return rows


def shared_beginnings(requests: int, context: int, calls: int, threads: int) -> dict:
    """One layer's attention of a batched decode step (kvb_attention_segments) for `requests` requests whose first
    `context` keys and values hold the same bits (one document in several conversations): median us with each
    request reading its own copy, and with the later ones reading the first one's (block_forward.py's leads), their
    buffers rotated past the caches; and whether the outputs are the same bits."""
    lib = gguf_blocks.library()
    room = context + 64
    copies = max(2, PAST_CACHES // (2 * requests * KV_HEADS * room * HEAD_DIM * 4))
    keys = [[torch.randn(KV_HEADS, room, HEAD_DIM) for _ in range(requests)] for _ in range(copies)]
    values = [[torch.randn(KV_HEADS, room, HEAD_DIM) for _ in range(requests)] for _ in range(copies)]
    for c in range(copies):
        for s in range(1, requests):
            keys[c][s][:, :context] = keys[c][0][:, :context]
            values[c][s][:, :context] = values[c][0][:, :context]
    queries = [torch.randn(HEADS, 1, HEAD_DIM) for _ in range(requests)]
    outs = [torch.empty(1, HEADS, HEAD_DIM) for _ in range(requests)]

    def numbers(kind, items):
        return (kind * len(items))(*items)

    pointers = ctypes.c_void_p
    nq, nk = numbers(ctypes.c_int64, [1] * requests), numbers(ctypes.c_int64, [context + 1] * requests)
    stride = numbers(ctypes.c_int64, [room * HEAD_DIM] * requests)
    q = numbers(pointers, [t.data_ptr() for t in queries])
    out = numbers(pointers, [t.data_ptr() for t in outs])

    def attend(copy: int, one: bool) -> float:
        k = numbers(pointers, [t.data_ptr() for t in keys[copy]])
        v = numbers(pointers, [t.data_ptr() for t in values[copy]])
        lead_k = numbers(pointers, [keys[copy][0].data_ptr()] * requests)
        lead_v = numbers(pointers, [values[copy][0].data_ptr()] * requests)
        shared = numbers(ctypes.c_int64, [0] + [context] * (requests - 1))
        leads = [ctypes.addressof(a) for a in (lead_k, lead_v, stride, shared)] if one else [None] * 4
        start = time.perf_counter()
        status = lib.kvb_attention_segments(requests, *[ctypes.addressof(a) for a in (q, k, v, stride, nq, nk, out)],
                                            HEADS, KV_HEADS, HEAD_DIM, ctypes.c_float(HEAD_DIM ** -0.5), threads,
                                            *leads)
        if status != 0:
            raise MemoryError("no scratch memory for attention")
        return time.perf_counter() - start

    spent: dict[bool, list[float]] = {False: [], True: []}
    for call in range(calls):
        for one in (False, True):
            spent[one].append(attend(call % copies, one))
    results = []
    for one in (False, True):
        attend(0, one)
        results.append([t.clone() for t in outs])
    return {"own": 1e6 * statistics.median(spent[False]), "one": 1e6 * statistics.median(spent[True]),
            "same": all(torch.equal(a, b) for a, b in zip(*results))}


# The instructions the tiles multiply with on AVX-512 VNNI: vpdpwssd for the 32-value types (gguf_dots.c, tile32:
# int16 pairs multiplied and added into 16 int32 lanes) and vpdpbusd for the K-quants (ktiles.c: four u8 x s8
# products a lane). Each timed alone, in independent chains on every thread, and with the other operations of a
# tile's block for one row interleaved: the 32-value types' float steps (4 float multiply-adds per 16 products), and
# a Q4_K block's (per 64 vpdpbusd: 8 vpmulld for the sub-block scales, 4 vpdpwssd for the mins, 2 float
# multiply-adds and 2 float multiplies), or as many operations that multiply nothing (and, add, shift, convert).
# Zen 4 runs the multiplying ones on the same two pipes as the products, the others beside them: the mixes show what
# the product of many rows can reach on this CPU. (Only there: on AVX2, a compiler folds the probe's loop-invariant
# vpmaddwd away, and such a loop would time something else.)
CEILING_SOURCE = r"""
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#if !(defined(__AVX512F__) && defined(__AVX512VNNI__))
#error "no AVX-512 VNNI"
#endif
typedef __m512i vi; typedef __m512 vf;
#define LANES 16
#define KEEP(r) __asm__ volatile("" : "+v"(r))
/* 16 of the mode's instructions, in 16 chains: with 8 (each instruction waiting ~5 cycles for its sum) the loop
   timed the instruction's latency, not its rate: 0.8x the rate of 16 chains on a 2-vCPU Xeon */
#define PRODUCTS(OP) \
    a0 = OP(a0, x, y); a1 = OP(a1, x, y); a2 = OP(a2, x, y); a3 = OP(a3, x, y); \
    a4 = OP(a4, x, y); a5 = OP(a5, x, y); a6 = OP(a6, x, y); a7 = OP(a7, x, y); \
    a8 = OP(a8, x, y); a9 = OP(a9, x, y); a10 = OP(a10, x, y); a11 = OP(a11, x, y); \
    a12 = OP(a12, x, y); a13 = OP(a13, x, y); a14 = OP(a14, x, y); a15 = OP(a15, x, y);
enum { WSSD, WSSD_FLOAT, BUSD, BUSD_Q4K, BUSD_OTHER, MODES };
static long rounds;
static int mode;
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static void *work(void *unused) {
    (void)unused;
    vi a0 = _mm512_set1_epi32(0), a1 = _mm512_set1_epi32(1), a2 = _mm512_set1_epi32(2), a3 = _mm512_set1_epi32(3);
    vi a4 = _mm512_set1_epi32(4), a5 = _mm512_set1_epi32(5), a6 = _mm512_set1_epi32(6), a7 = _mm512_set1_epi32(7);
    vi a8 = a0, a9 = a1, a10 = a2, a11 = a3, a12 = a4, a13 = a5, a14 = a6, a15 = a7;
    vi x = _mm512_set1_epi32(3), y = _mm512_set1_epi32(5), m0 = x, m1 = y, w = x, b0 = x, b1 = y, b2 = x;
    vf f0 = _mm512_set1_ps(0.f), f1 = _mm512_set1_ps(1.f), f2 = _mm512_set1_ps(2.f), f3 = _mm512_set1_ps(3.f);
    vf s = _mm512_set1_ps(1.0001f), g = s, c = s;
    KEEP(x); KEEP(y); /* unknown to the compiler: a multiply by a constant would become shifts and adds */
    for (long i = 0; i < rounds; i++) {
        if (mode <= WSSD_FLOAT) {
            PRODUCTS(_mm512_dpwssd_epi32)
        } else {
            PRODUCTS(_mm512_dpbusd_epi32) PRODUCTS(_mm512_dpbusd_epi32)
        }
        if (mode == WSSD_FLOAT) {
            f0 = _mm512_fmadd_ps(f0, s, s); f1 = _mm512_fmadd_ps(f1, s, s);
            f2 = _mm512_fmadd_ps(f2, s, s); f3 = _mm512_fmadd_ps(f3, s, s);
            KEEP(f0); KEEP(f1); KEEP(f2); KEEP(f3);
        } else if (mode == BUSD_Q4K) { /* a Q4_K block's share per 32 vpdpbusd */
            m0 = _mm512_mullo_epi32(m0, x); m1 = _mm512_mullo_epi32(m1, x); KEEP(m0); KEEP(m1);
            m0 = _mm512_mullo_epi32(m0, y); m1 = _mm512_mullo_epi32(m1, y); KEEP(m0); KEEP(m1);
            w = _mm512_dpwssd_epi32(w, x, y); KEEP(w); w = _mm512_dpwssd_epi32(w, y, x); KEEP(w);
            f0 = _mm512_fmadd_ps(f0, s, s); g = _mm512_mul_ps(g, s); KEEP(f0); KEEP(g);
        } else if (mode == BUSD_OTHER) { /* as many operations that multiply nothing */
            b0 = _mm512_and_si512(b0, y); b1 = _mm512_add_epi32(b1, x); KEEP(b0); KEEP(b1);
            b2 = _mm512_srli_epi16(b2, 1); c = _mm512_cvtepi32_ps(b1); KEEP(b2); KEEP(c);
            b0 = _mm512_or_si512(b0, x); b1 = _mm512_sub_epi32(b1, y); KEEP(b0); KEEP(b1);
            b2 = _mm512_slli_epi16(b2, 1); c = _mm512_cvtepi32_ps(b0); KEEP(b2); KEEP(c);
        }
        KEEP(a0); KEEP(a1); KEEP(a2); KEEP(a3); KEEP(a4); KEEP(a5); KEEP(a6); KEEP(a7);
        KEEP(a8); KEEP(a9); KEEP(a10); KEEP(a11); KEEP(a12); KEEP(a13); KEEP(a14); KEEP(a15);
    }
    return NULL;
}
int main(int argc, char **argv) {
    int threads = atoi(argv[1]);
    rounds = atol(argv[2]);
    if (threads < 1 || threads > 64 || rounds < 1) return 2;
    double best[MODES] = {0};
    for (int repeat = 0; repeat < 3; repeat++) /* the modes in turn, the best of three each */
        for (mode = 0; mode < MODES; mode++) {
            pthread_t t[64];
            double start = now();
            for (int i = 0; i < threads; i++) pthread_create(&t[i], NULL, work, NULL);
            for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
            const double seconds = now() - start, products = mode <= WSSD_FLOAT ? 16.0 * 2 : 32.0 * 4;
            const double rate = products * rounds * threads * LANES / seconds / 1e9;
            if (rate > best[mode]) best[mode] = rate;
        }
    for (mode = 0; mode < MODES; mode++) printf("%d %.3f\n", LANES, best[mode]);
    return 0;
}
"""


class Ceiling(NamedTuple):
    """This CPU's multiply-add rates in GMAC/s on the probe's threads (CEILING_SOURCE)."""
    lanes: int
    wssd: float  # vpdpwssd alone
    wssd_float: float  # with the 32-value types' float steps
    busd: float  # vpdpbusd alone
    busd_q4k: float  # with a Q4_K block's other multiplying operations
    busd_other: float  # with as many operations that multiply nothing


def ceiling(threads: int, rounds: int = 10_000_000) -> Ceiling | None:
    """This CPU's vpdpwssd and vpdpbusd rates on `threads` threads (Ceiling), the best of three runs of each loop in
    turn; None where the probe cannot be built here (no C compiler, no AVX-512 VNNI)."""
    import shutil
    import subprocess
    import tempfile

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    with tempfile.TemporaryDirectory() as folder:
        source, program = Path(folder) / "ceiling.c", Path(folder) / "ceiling"
        source.write_text(CEILING_SOURCE)
        built = subprocess.run([compiler, "-O2", "-march=native", "-pthread", str(source), "-o", str(program)],
                               capture_output=True, text=True)
        if built.returncode != 0:
            return None
        lines = subprocess.run([str(program), str(threads), str(rounds)], capture_output=True, text=True,
                               check=True).stdout.split("\n")
    rows = [line.split() for line in lines[:5]]
    return Ceiling(int(rows[0][0]), *(float(rate) for _, rate in rows))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=400, help="calls per row count (alternating)")
    parser.add_argument("--type", default="Q4_1", choices=sorted(SHAPES), help="the weight's block type")
    parser.add_argument("--copies", type=int, default=None,
                        help="weight copies rotated (default: 110 MB of them, past L3)")
    parser.add_argument("--context", default="150,1700", help="cached tokens for attention, comma-separated")
    parser.add_argument("--requests", type=int, default=0,
                        help="also time a batched step's attention for this many requests whose first --context "
                             "tokens (the first value) are alike: each reading its own copy, and one copy")
    parser.add_argument("--ceiling", action="store_true",
                        help="also time this CPU's vpdpwssd and vpdpbusd, the tiles' instructions, alone and with a "
                             "block's other steps (needs cc and AVX-512 VNNI)")
    parser.add_argument("--against", metavar="LIBRARY",
                        help="also time the products side by side with another build of the kernel (the library "
                             "another checkout built: gguf_blocks.library()._name there), calls alternating")
    args = parser.parse_args(argv)
    try:
        contexts = [int(c) for c in args.context.split(",") if c.strip()]
    except ValueError:
        parser.error(f"--context takes token counts separated by commas, not {args.context!r}")
    copies = args.copies if args.copies is not None else default_copies(args.type)
    if args.ceiling and args.threads > 64:
        parser.error("--ceiling: its probe runs 1 to 64 threads")
    if min(args.threads, args.calls, copies) < 1 or not contexts or min(contexts) < 1:
        parser.error("--threads, --calls, --copies and every --context must be at least 1")
    if not 0 <= args.requests <= 64:
        parser.error("--requests: 0 (off) to 64")
    if reason := gguf_blocks.unavailable("cpu"):
        raise SystemExit(f"bench kernels: no block kernel here: {reason}")
    torch.set_num_threads(args.threads)
    out_features, columns = SHAPES[args.type][:2]
    print(f"{args.type} {out_features} x {columns} {'as tiles' if gguf_blocks.tiles(args.type) else 'as rows'}, "
          f"{args.threads} threads, {copies} weight copies, medians of {args.calls} calls")
    print("| rows | us | GMAC/s | cost / one row |\n|---|---|---|---|")
    for r in products(list(range(1, 9)), args.calls, copies, args.type):
        print(f"| {r['rows']} | {r['us']:.1f} | {r['gmacs']:.1f} | {r['cost']:.2f}x |")
    if args.against:
        print(f"\nthe same products, this build against {args.against}, alternating, medians of {args.calls} calls "
              "(outputs apart: the largest difference / the largest output; 0 = the same bits)")
        print("| rows | this build us | the other us | this / other | outputs apart |\n|---|---|---|---|---|")
        for r in side_by_side(list(range(1, 9)), args.calls, copies, args.against, args.type):
            print(f"| {r['rows']} | {r['this']:.1f} | {r['other']:.1f} | {r['this'] / r['other']:.3f} | "
                  f"{r['apart']:.1e} |")
    if args.ceiling:
        found = ceiling(args.threads)
        if found is None:
            print("\nno probe of the multiply-adds here (it needs a C compiler and AVX-512 VNNI)")
        else:
            print(f"\nthis CPU's multiply-adds ({found.lanes} int32 lanes), {args.threads} threads, GMAC/s: the most "
                  "the products of many rows can reach here\n| instruction | alone | with a block's other steps | "
                  "share |\n|---|---|---|---|\n"
                  f"| vpdpwssd (32-value types) | {found.wssd:.1f} | {found.wssd_float:.1f} (4 float multiply-adds "
                  f"per 16) | {found.wssd_float / found.wssd:.0%} |\n"
                  f"| vpdpbusd (K-quants) | {found.busd:.1f} | {found.busd_q4k:.1f} (Q4_K: 8 vpmulld, 4 vpdpwssd, "
                  f"4 float operations per 64) | {found.busd_q4k / found.busd:.0%} |\n"
                  f"| vpdpbusd (K-quants) | {found.busd:.1f} | {found.busd_other:.1f} (as many operations that "
                  f"multiply nothing) | {found.busd_other / found.busd:.0%} |")
    for context in contexts:
        against = f", this build against {args.against}" if args.against else ""
        print(f"\nrow attention, one layer ({HEADS} heads, {KV_HEADS} kv heads of {HEAD_DIM}), {context} cached "
              f"tokens, keys and values rotated past L3{against}")
        found = attention([1, 4, 5, 9], context, max(args.calls // 4, 20), args.threads, args.against)
        if args.against:
            print("| positions | this build us | the other us | this / other | same bits |\n|---|---|---|---|---|")
            for a in found:
                print(f"| {a['positions']} | {a['us']:.1f} | {a['other']:.1f} | {a['us'] / a['other']:.3f} | "
                      f"{'yes' if a['same'] else 'NO'} |")
        else:
            print("| positions | us | cost / one position |\n|---|---|---|")
            for a in found:
                print(f"| {a['positions']} | {a['us']:.1f} | {a['cost']:.2f}x |")
    if args.requests:
        found = shared_beginnings(args.requests, contexts[0], args.calls, args.threads)
        print(f"\na batched step's attention, one layer, {args.requests} requests whose first {contexts[0]} cached "
              f"tokens are alike, buffers rotated past L3, medians of {args.calls} calls alternating\n"
              "| each reads its own copy | all read the first one's | one copy / own copies | same bits |\n"
              f"|---|---|---|---|\n| {found['own']:.1f} us | {found['one']:.1f} us | "
              f"{found['one'] / found['own']:.2f}x | {'yes' if found['same'] else 'NO'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
