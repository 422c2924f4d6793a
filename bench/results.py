"""What a benchmark workload measured (requests per mode, per step; targets) and how it prints: markdown tables
for the terminal and docs/benchmarks.md, and a dict for --json."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Sequence

REFERENCE = "off"  # the mode every other is compared with: speedup and agreement


@dataclass
class Request:
    """One request of one mode, as measured."""

    mode: str
    ttft_ms: float
    total_ms: float
    prompt_tokens: int
    reused_tokens: int
    generated_tokens: int
    repaired_tokens: int  # reused tokens recomputed by seam repair (approx)
    store_ms: float  # storing new KV, after the first token
    finish_reason: str
    token_ids: list[int]
    text: str
    chunks: list[tuple[int, int, str]]  # (start, end, EXACT | PREFIX | MISS) per prompt segment
    first_token_agree: bool = True  # with "off" on the same prompt
    all_tokens_agree: bool = True
    kl: float = 0.0  # KL(off || mode) of the next-token distribution at the end of the prompt
    doc_hit_pct: float | None = None  # rag: share of the documents' tokens served from the store
    correct: bool | None = None  # needle-QA: the expected answer is in the reply

    @property
    def reused_fraction(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class Step:
    """One prompt sent to every mode."""

    label: str
    requests: dict[str, Request]


@dataclass
class Target:
    workload: str
    mode: str
    what: str
    value: float
    target: float
    higher_is_better: bool
    unit: str = "x"

    @property
    def passed(self) -> bool:
        return self.value >= self.target if self.higher_is_better else self.value <= self.target

    def line(self) -> str:
        sign = ">=" if self.higher_is_better else "<="
        return (f"{'PASS' if self.passed else 'MISS'}  {self.workload} / {self.mode}: {self.what} "
                f"{self.value:.2f}{self.unit} (target {sign} {self.target:g}{self.unit})")


@dataclass
class Workload:
    name: str
    description: str
    params: dict
    steps: list[Step] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)

    @property
    def modes(self) -> list[str]:
        return list(self.steps[0].requests)

    def warm_steps(self) -> list[Step]:
        return self.steps[1:] if len(self.steps) > 1 else self.steps

    def summary(self) -> dict[str, dict]:
        """Per mode, over the warm steps: median TTFT, speedup vs off, mean reuse, agreement with off."""
        warm = self.warm_steps()
        medians = {m: statistics.median(s.requests[m].ttft_ms for s in warm) for m in self.modes}
        out = {}
        for mode in self.modes:
            reqs = [s.requests[mode] for s in warm]
            out[mode] = {
                "median_ttft_ms": medians[mode],
                "speedup": medians[REFERENCE] / medians[mode],
                "reused_pct": 100 * statistics.fmean(r.reused_fraction for r in reqs),
                "first_token_agree_pct": 100 * statistics.fmean(r.first_token_agree for r in reqs),
                "all_tokens_agree_pct": 100 * statistics.fmean(r.all_tokens_agree for r in reqs),
                "mean_kl": statistics.fmean(r.kl for r in reqs),
            }
            if reqs[0].doc_hit_pct is not None:
                out[mode]["doc_hit_pct"] = statistics.fmean(r.doc_hit_pct for r in reqs)
            if reqs[0].correct is not None:
                out[mode]["accuracy_pct"] = 100 * statistics.fmean(bool(r.correct) for r in reqs)
        return out


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]

    def line(cells):
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def step_table(wl: Workload, max_new_tokens: int) -> str:
    headers = ["request", "prompt tok", "off ms"]
    for mode in wl.modes[1:]:
        headers += [f"{mode} ms", f"{mode} reused", f"{mode} x", f"{mode} agree 1st/{max_new_tokens}"]
    rows = []
    for step in wl.steps:
        off = step.requests[REFERENCE]
        row = [step.label, str(off.prompt_tokens), f"{off.ttft_ms:.0f}"]
        for mode in wl.modes[1:]:
            r = step.requests[mode]
            row += [f"{r.ttft_ms:.0f}", f"{100 * r.reused_fraction:.0f}%", f"{off.ttft_ms / r.ttft_ms:.1f}",
                    f"{_yes(r.first_token_agree)}/{_yes(r.all_tokens_agree)}"]
        rows.append(row)
    return markdown_table(headers, rows)


def summary_table(workloads: Sequence[Workload], max_new_tokens: int) -> str:
    headers = ["workload", "mode", "median TTFT ms", "speedup vs off", "reused %", "document hit %",
               "first-token agree", f"{max_new_tokens}-token agree", "mean KL", "needle accuracy"]
    rows = []
    for wl in workloads:
        for mode, s in wl.summary().items():
            accuracy = f"{s['accuracy_pct']:.1f}%" if "accuracy_pct" in s else ""
            hits = f"{s['doc_hit_pct']:.0f}%" if "doc_hit_pct" in s else ""
            rows.append([wl.name, mode, f"{s['median_ttft_ms']:.0f}", f"{s['speedup']:.2f}x",
                         f"{s['reused_pct']:.0f}%", hits, f"{s['first_token_agree_pct']:.0f}%",
                         f"{s['all_tokens_agree_pct']:.0f}%", f"{s['mean_kl']:.3f}", accuracy])
    return markdown_table(headers, rows)


def workload_dict(wl: Workload) -> dict:
    return {
        "description": wl.description, "params": wl.params,
        "steps": [{"label": s.label, "requests": {m: asdict(r) for m, r in s.requests.items()}} for s in wl.steps],
        "summary": wl.summary(),
        "targets": [{**asdict(t), "passed": t.passed} for t in wl.targets],
    }
