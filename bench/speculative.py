"""`python -m bench speculative`: prompt-lookup speculative decoding against one token per forward, side by side.

Workloads: `quote` (a document in the prompt, the question asks for a passage of it: answers that quote),
`needle` (bench.needle's document questions: five documents, a short answer) and `chat` (free questions, no
document: little to draft from). Every prompt is answered by the plain engine and by the speculative one in turn,
`--repeats` times (the order swapped each time), greedy, reuse off (the decode loop is what is measured); per
prompt the median decode tokens/s of each, then per workload the median of the per-prompt ratios, the share of
drafted tokens kept, tokens per decode forward and whether every answer is the same text. Numbers are noisy on a
shared machine (a short answer's decode takes ~0.1 s: one answer each way moved a prompt's ratio by +-0.3x from
run to run); compare the columns of one run.

`--replay` times nothing but the cost of a forward of 1-N positions: it answers each prompt once, greedily, and
replays the drafts the decode loop would make for that answer with engine.speculative's index as it is and with
one of its rules changed at a time, against those costs (a greedy answer is the same whatever is drafted, so
the checks are known without running them). How the index's rules were chosen; the drafts replayed are the loop's
own (a test compares them).
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


def replay(prompt: Sequence[int], answer: Sequence[int], stopped: bool, index, num_draft: int,
           max_new_tokens: int) -> list[tuple[list[int], int]]:
    """The checks engine.generate's decode loop makes for a greedy `answer` to `prompt` (`stopped`: it ended
    with EOS, else at max_new_tokens), drafting from `index` (a speculative.NgramIndex of `prompt`, or None for
    no drafts): (drafted tokens, how many were kept) per forward."""
    from engine.speculative import draft_limit

    upcoming: list[int | None] = [*answer, *([None] if stopped else [])]  # None: EOS
    generated, at, copying, checks = 0, 1, False, []
    token = upcoming[0] if upcoming else None
    while token is not None:
        if index is not None:
            index.append(token)
        generated += 1
        if generated >= max_new_tokens:
            break
        room = max_new_tokens - generated
        draft = index.draft(min(draft_limit(num_draft, copying), room)) if index is not None else []
        kept = 0
        while kept < len(draft) and at + kept < len(upcoming) and upcoming[at + kept] == draft[kept]:
            kept += 1
        checks.append((draft, kept))
        copying = bool(draft) and kept == len(draft)
        for accepted in draft[:kept]:
            index.append(accepted)
            generated += 1
            if generated >= max_new_tokens:
                return checks
        at += kept
        token = upcoming[at] if at < len(upcoming) else None
        at += 1
    return checks


REPLAYED = {"the index as it is": {}, "tokens by id (no spellings)": {"spelling": None},
            "no pairs": {"pair_seen": 0}, "a pair after one sighting": {"pair_seen": 1},
            "the latest occurrence (no longest match)": {"candidates": 1}}


def replay_rows(engine, num_draft: int, num_prompts: int, max_new_tokens: int, costs: Sequence[float]) -> list[dict]:
    """Per variant of the index (REPLAYED) and workload: the median over prompts of plain cost / drafted cost,
    `costs[n - 1]` being a forward of n positions (costs[0] = 1)."""
    from engine.speculative import NgramIndex, Spellings

    spelling = Spellings(engine.tokenizer)
    answers = {name: [(engine.encode(m), engine.chat(m, max_new_tokens=max_new_tokens)) for m in prompts]
               for name, prompts in workloads(num_prompts).items()}
    # per answer: its prompt, tokens, whether it stopped, and its forwards without drafts (the same for every variant)
    replays = {name: [(prompt, result.token_ids, result.finish_reason == "stop",
                       len(replay(prompt, result.token_ids, result.finish_reason == "stop", None, num_draft,
                                  max_new_tokens))) for prompt, result in pairs] for name, pairs in answers.items()}
    rows = []
    for variant, change in REPLAYED.items():
        settings = {"spelling": spelling, **change}
        row = {"variant": variant}
        for name, answered in replays.items():
            ratios = []
            for prompt, tokens, stopped, plain in answered:
                checks = replay(prompt, tokens, stopped, NgramIndex(prompt, **settings), num_draft, max_new_tokens)
                if plain and all(len(d) < len(costs) for d, _ in checks):
                    ratios.append(plain / sum(costs[len(d)] for d, _ in checks))
            row[name] = statistics.median(ratios) if ratios else float("nan")
            row[name + "_lowest"] = min(ratios) if ratios else float("nan")
        rows.append(row)
    return rows


def replay_table(rows: list[dict]) -> str:
    lines = ["| drafts from | quote | needle | chat (lowest prompt) |", "|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['quote']:.2f}x | {r['needle']:.2f}x | {r['chat']:.2f}x "
              f"({r['chat_lowest']:.2f}x) |" for r in rows]
    return "\n".join(lines)


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
    parser.add_argument("--replay", action="store_true",
                        help="replay the drafts of each prompt's greedy answer against measured forward costs")
    parser.add_argument("--costs", default=None,
                        help="with --replay: the cost of a forward of 1, 2, 3... positions, comma-separated (1 first), "
                             "instead of measuring them")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    costs = None
    if args.costs is not None:
        try:
            costs = [float(x) for x in args.costs.split(",")]
        except ValueError:
            parser.error(f"--costs: comma-separated numbers, got {args.costs!r}")
        if not costs or costs[0] != 1.0 or any(not 0 < c < 1000 for c in costs):
            parser.error("--costs: positive numbers, the first 1")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    from engine import KVBoost

    engine = KVBoost.from_pretrained(args.model, device="cpu", weights=args.weights, reuse="off",
                                     disk_cache_bytes=0, quiet=True, speculative=None)
    if args.replay:
        from engine.speculative import draft_limit

        k = int(args.drafts.split(",")[0])
        longest = draft_limit(k, True) + 1
        if costs is None:
            from bench.step import positions_cost

            measured = positions_cost(args.model, prompt_tokens=1400, counts=range(1, longest + 1), rounds=30)
            costs = [measured[n]["ms"] / measured[1]["ms"] for n in range(1, longest + 1)]
        if len(costs) < longest:
            parser.error(f"--costs: {longest} values needed ({k} drafts, {longest - 1} while copying)")
        print("cost of a forward of n positions: " + ", ".join(f"{n + 1}: {c:.2f}x" for n, c in enumerate(costs)))
        print(f"drafts: {k}, prompts: {args.prompts} a workload, medians of plain cost / drafted cost")
        print(replay_table(replay_rows(engine, k, args.prompts, args.new_tokens, costs)))
        return 0
    rows = []
    for k in (int(x) for x in args.drafts.split(",")):
        rows += run(engine, k, args.prompts, args.new_tokens, args.repeats)
    print(f"weights: {engine.info().weights.format}, threads: {torch.get_num_threads()}, "
          f"answers each way per prompt: {args.repeats}")
    print(table(rows))
    return 0
