"""`python -m bench speculative`: prompt-lookup speculative decoding against one token per forward, side by side.

Workloads: `quote` (a document in the prompt, the question asks for a passage of it: answers that quote),
`needle` (bench.needle's document questions: five documents, a short answer) and `chat` (free questions, no
document: little to draft from). Every prompt is answered by the plain engine and by the speculative one in turn,
`--repeats` times (the order swapped each time), greedy, reuse off (the decode loop is what is measured); per
prompt the median decode tokens/s of each, then per workload the median of the per-prompt ratios, the share of
drafted tokens kept, tokens per decode forward and whether every answer is the same text. Numbers are noisy on a
shared machine (a short answer's decode takes ~0.1 s: one answer each way moved a prompt's ratio by +-0.3x from
run to run); compare the columns of one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Sequence

import torch

QUOTE_TOPICS = ("assignment", "for", "while", "if", "try", "with", "import", "return")
CHAT = ("Write a short story about a cat who learns to fly.", "Explain how a bicycle works to a child.",
        "Give me three tips for sleeping better.", "What should I pack for a weekend hiking trip?",
        "Describe the water cycle.", "Why is the sky blue?", "Write a haiku about autumn and explain it.",
        "How do I make a good cup of tea?")


def workloads(num_prompts: int) -> dict[str, list[list[dict]]]:
    import pydoc_data.topics

    from bench import needle

    topics = pydoc_data.topics.topics
    quote = [[{"role": "system", "content": topics[name][:1800]},
              {"role": "user", "content": "Repeat the first paragraph of the text above word for word."}]
             for name in QUOTE_TOPICS[:num_prompts]]
    docs = needle.make_documents()
    needles = [needle.messages_for(docs, q) for q in needle.make_questions(docs, num_prompts)]
    chat = [[{"role": "user", "content": text}] for text in CHAT[:num_prompts]]
    return {"quote": quote, "needle": needles, "chat": chat}


def run(engine, num_draft: int, num_prompts: int, max_new_tokens: int, repeats: int = 1) -> list[dict]:
    spec = engine.with_options(speculative="prompt-lookup", num_draft=num_draft)
    rows = []
    for name, prompts in workloads(num_prompts).items():
        ratios, base_tps, spec_tps, same, drafted, kept, forwards, tokens = [], [], [], [], 0, 0, 0, 0
        for messages in prompts:
            answers: dict = {"plain": [], "fast": []}
            for turn in range(repeats):  # alternating which goes first: the machine's drift hits both alike
                for which in (("plain", "fast") if turn % 2 == 0 else ("fast", "plain")):
                    answers[which].append((engine if which == "plain" else spec).chat(
                        messages, max_new_tokens=max_new_tokens))
            plain, fast = answers["plain"][0], answers["fast"][0]
            same.append(all(a.token_ids == plain.token_ids for a in answers["plain"] + answers["fast"]))
            plain_tps = [a.stats.decode_tokens_per_s for a in answers["plain"] if a.stats.decode_tokens_per_s]
            fast_tps = [a.stats.decode_tokens_per_s for a in answers["fast"] if a.stats.decode_tokens_per_s]
            if plain_tps and fast_tps:
                base_tps.append(statistics.median(plain_tps))
                spec_tps.append(statistics.median(fast_tps))
                ratios.append(spec_tps[-1] / base_tps[-1])
            drafted += fast.stats.drafted_tokens
            kept += fast.stats.accepted_tokens
            forwards += fast.stats.decode_forwards
            tokens += max(len(fast.token_ids) - 1, 0)
            print(f"  {name}: {len(same)}/{len(prompts)}", file=sys.stderr)
        rows.append({"workload": name, "num_draft": num_draft, "prompts": len(prompts),
                     "base_tps": statistics.median(base_tps) if base_tps else float("nan"),
                     "spec_tps": statistics.median(spec_tps) if spec_tps else float("nan"),
                     "speedup": statistics.median(ratios) if ratios else float("nan"),
                     "accepted": kept / drafted if drafted else 0.0,
                     "tokens_per_forward": tokens / forwards if forwards else 0.0, "same_text": all(same)})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| workload | drafts | prompts | decode tok/s plain | speculative | speedup (median) | drafts kept | "
             "tokens / forward | same greedy text |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['num_draft']} | {r['prompts']} | {r['base_tps']:.1f} | "
                     f"{r['spec_tps']:.1f} | {r['speedup']:.2f}x | {r['accepted']:.0%} | "
                     f"{r['tokens_per_forward']:.2f} | {'yes' if r['same_text'] else 'NO'} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench speculative", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--weights", default="auto", choices=("auto", "float", "int4"))
    parser.add_argument("--drafts", default="4,8", help="num_draft values, comma-separated")
    parser.add_argument("--prompts", type=int, default=6, help="prompts per workload")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="answers each way per prompt, order alternating")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    from engine import KVBoost

    engine = KVBoost.from_pretrained(args.model, device="cpu", weights=args.weights, reuse="off",
                                     disk_cache_bytes=0, quiet=True, speculative=None)
    rows = []
    for k in (int(x) for x in args.drafts.split(",")):
        rows += run(engine, k, args.prompts, args.new_tokens, args.repeats)
    print(f"weights: {engine.info().weights.format}, threads: {torch.get_num_threads()}, "
          f"answers each way per prompt: {args.repeats}")
    print(table(rows))
    return 0
