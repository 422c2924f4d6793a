"""One measured step of the side-by-side benchmarks (bench.reuse, bench.needle_qa): a request sent to every engine
in turn, the reference first, and the targets approximate reuse is held to."""

from __future__ import annotations

from typing import Callable

import torch

from .results import REFERENCE, Request, Step, Target, Workload

Progress = Callable[[str], None]


def measure(engines: dict, label: str, messages: list[dict], max_new_tokens: int) -> Step:
    """Sends `messages` to every engine in order (the reference first)."""
    requests = {}
    logits = {}
    for mode, engine in engines.items():
        result = engine.generate(messages, max_new_tokens=max_new_tokens, temperature=0.0, return_logits=True)
        if result.first_logits is not None:  # the peer row has none
            logits[mode] = torch.log_softmax(result.first_logits.double(), dim=-1)
        stats = result.stats
        requests[mode] = Request(mode, stats.ttft_ms, stats.total_ms, stats.prompt_tokens, stats.reused_tokens,
                                 stats.generated_tokens, stats.repaired_tokens, stats.store_ms, result.finish_reason,
                                 list(result.token_ids), result.text, [tuple(c) for c in stats.chunks])
    reference = requests[REFERENCE].token_ids
    for request in requests.values():
        # Both empty (EOS first) counts as agreeing.
        request.first_token_agree = request.token_ids[:1] == reference[:1]
        request.all_tokens_agree = request.token_ids == reference
        ref = logits[REFERENCE]
        mine = logits.get(request.mode)
        request.kl = float((ref.exp() * (ref - mine)).sum()) if mine is not None else float("nan")
    return Step(label, requests)


def add_approx_targets(wl: Workload) -> None:
    """The targets of approximate reuse on reordered documents, for every approx mode that ran."""
    summary = wl.summary()
    prefix = summary.get("prefix")
    for mode in wl.modes:
        if not mode.startswith("approx"):
            continue
        s = summary[mode]
        wl.targets.append(Target(wl.name, mode, "median TTFT speedup vs off", s["speedup"], 4.5, True))
        if prefix is not None:
            wl.targets.append(Target(wl.name, mode, "median TTFT speedup vs prefix",
                                     prefix["median_ttft_ms"] / s["median_ttft_ms"], 2.0, True))
        wl.targets.append(Target(wl.name, mode, "mean KL vs off", s["mean_kl"], 0.05, False, unit=""))
        wl.targets.append(Target(wl.name, mode, "first-token agreement %", s["first_token_agree_pct"], 95, True,
                                 unit="%"))
