"""The diagnostic curve of approximate reuse: needle accuracy and KL against full prefill as a function of how much
of the reused KV is recomputed (CacheBlend's ratio from 0 to 1, and selective repair's tokens per seam), on the
needle workload of `kvboost bench` (bench.needle_qa: every document warmed alone, then asked about among others in a
new order). 100% recomputation must give full prefill's accuracy; the curve is expected to rise toward it.

    python -m bench approx-curve                          # cacheblend 0..1 and selective 0/16/64, table + PNG
    python -m bench approx-curve --png curve.png --json curve.json

The PNG needs matplotlib (`pip install matplotlib`); without it the table is printed and the PNG skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from .modes import engine_for
from .needle_qa import run_needle
from .results import REFERENCE
from .text import FULL, QUICK

RATIOS = (0.0, 0.05, 0.15, 0.3, 0.5, 0.75, 1.0)
SELECTIVE = (0, 16, 64)


def modes_for(ratios: Sequence[float], selective: Sequence[int]) -> dict[str, tuple[str, float]]:
    """mode name -> (family, x): x the share recomputed (cacheblend) or tokens per seam (selective)."""
    out = {f"approx:cacheblend@{r:g}": ("cacheblend", float(r)) for r in ratios}
    for k in selective:
        out["approx:none" if k == 0 else f"approx:selective@{k}"] = ("selective", float(k))
    return out


def measure(engine, ratios: Sequence[float], selective: Sequence[int], quick: bool, progress) -> dict:
    modes = modes_for(ratios, selective)
    engines = {REFERENCE: engine_for(engine, REFERENCE), **{m: engine_for(engine, m) for m in modes}}
    wl = run_needle(engines, None, None, QUICK if quick else FULL, progress)
    summary = wl.summary()
    full = summary[REFERENCE]
    rows = [{"mode": REFERENCE, "family": "full prefill", "x": 1.0, "accuracy_pct": full["accuracy_pct"],
             "mean_kl": 0.0, "median_ttft_ms": full["median_ttft_ms"], "speedup": 1.0}]
    for mode, (family, x) in modes.items():
        s = summary[mode]
        rows.append({"mode": mode, "family": family, "x": x, "accuracy_pct": s["accuracy_pct"],
                     "mean_kl": s["mean_kl"], "median_ttft_ms": s["median_ttft_ms"],
                     "speedup": full["median_ttft_ms"] / s["median_ttft_ms"] if s["median_ttft_ms"] else 0.0})
    return {"questions": len(wl.steps), "rows": rows}


def table(result: dict) -> str:
    lines = ["| mode | recomputed | needle accuracy | mean KL vs full | median TTFT ms | TTFT speedup |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        what = ("all (full prefill)" if r["mode"] == REFERENCE else
                f"{100 * r['x']:.0f}% of reused tokens" if r["family"] == "cacheblend" else
                f"{r['x']:.0f} tokens per seam")
        lines.append(f"| {r['mode']} | {what} | {r['accuracy_pct']:.1f}% | {r['mean_kl']:.3f} | "
                     f"{r['median_ttft_ms']:.0f} | {r['speedup']:.2f}x |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> str | None:
    """Writes the curve to `path`; returns why not where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib)"
    rows = [r for r in result["rows"] if r["family"] == "cacheblend"]
    full = next(r for r in result["rows"] if r["mode"] == REFERENCE)
    fig, (acc, kl) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [100 * r["x"] for r in rows]
    acc.plot(xs, [r["accuracy_pct"] for r in rows], "o-", label="CacheBlend")
    acc.axhline(full["accuracy_pct"], linestyle="--", color="gray", label="full prefill")
    for r in rows:
        acc.annotate(f"{r['speedup']:.1f}x", (100 * r["x"], r["accuracy_pct"]), textcoords="offset points",
                     xytext=(0, 6), ha="center", fontsize=7)
    acc.set_xlabel("reused tokens recomputed past the probe layer (%)")
    acc.set_ylabel("needle accuracy (%)")
    acc.set_ylim(0, 100)
    acc.legend()
    acc.set_title("accuracy (labels: TTFT speedup)")
    kl.plot(xs, [r["mean_kl"] for r in rows], "o-", color="tab:red")
    kl.set_xlabel("reused tokens recomputed past the probe layer (%)")
    kl.set_ylabel("mean KL(full || approx), next token")
    kl.set_title("distance from full prefill")
    fig.suptitle(f"Approximate reuse on the needle workload ({result['questions']} questions)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench approx-curve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ratios", default=",".join(f"{r:g}" for r in RATIOS),
                        help="CacheBlend ratios, comma-separated (default %(default)s)")
    parser.add_argument("--selective", default=",".join(map(str, SELECTIVE)),
                        help="selective repair tokens per seam, comma-separated; 0 is no repair (default %(default)s)")
    parser.add_argument("--png", default="approx-curve.png", help="where the plot goes (default %(default)s)")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    parser.add_argument("--quick", action="store_true", help="a smoke test: 3 short questions")
    parser.add_argument("--model", default=None, help="model source (default: the built-in model)")
    args = parser.parse_args(argv)
    try:
        ratios = [float(r) for r in args.ratios.split(",") if r.strip()]
        selective = [int(k) for k in args.selective.split(",") if k.strip()]
    except ValueError:
        parser.error("--ratios takes numbers in [0, 1], --selective whole numbers")
    if any(not 0 <= r <= 1 for r in ratios) or any(k < 0 for k in selective):
        parser.error("--ratios takes numbers in [0, 1], --selective whole numbers >= 0")
    from engine import KVBoost

    def progress(message: str) -> None:
        print(f"[approx-curve] {message}", file=sys.stderr, flush=True)

    progress("loading model")
    engine = KVBoost.from_pretrained(args.model, disk_cache_bytes=0, quiet=True)
    result = measure(engine, ratios, selective, args.quick, progress)
    print(f"# Approximate reuse: the diagnostic curve ({result['questions']} needle questions, {engine.name})\n")
    print(table(result))
    why = plot(result, args.png)
    print(f"\nplot: {args.png}" if why is None else f"\nplot skipped: {why}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0
