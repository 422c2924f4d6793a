"""`python -m bench step`: where one decode step's time goes, and whether torch.compile of what runs in torch pays.

A decode step of a model under the one-call forward (engine.block_forward) is: the embedding (a C kernel over a
GGUF's table) and the rotary rows (looked up in engine.rotary_table), every layer in one C call, the final norm
and the head (C kernels called from torch modules), the pick of the next token (engine.sampling: greedy, or
sampled with --temperature and --top-p), and the Python between them. This loads the model as the engine does
(weights="auto", ROWS attention, the one-call forward, the rotary table), prefills a prompt, and times decode
steps, each part timed inside the step: the layers (the C call with its preparation: embedding, rotary rows,
cache reservation), the head (final norm and head), and the rest (the module call, the checks before it, the
pick). The step is a median; the parts are means per step, and the rest is the step less the parts.

With `--compile` a second copy of the model runs alongside, computing its rotary cos and sin (the step's one
pure-torch part) under torch.compile instead of looking them up; the two take turns step by step, so the
machine's noise hits them alike, and the table says whether their tokens stayed equal. The rest cannot be
compiled into a graph: the layers, the norm, the head and the GGUF embedding are C calls through ctypes (graph
breaks).

With `--positions 1,2,3,5,9` it times forwards of that many new positions over the prompt's cache instead (each
cropped back after), taking turns: what a speculative check of k drafts (k + 1 positions) or a batched step costs
in situ, against one position, with the cache and the weights read from memory as the engine reads them
(`python -m bench kernels` times the kernels alone, in cache).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Sequence

import torch

from engine.block_forward import use_block_forward
from engine.config import SamplingConfig
from engine.exact_attention import use_exact_attention
from engine.live_cache import GrowingCache
from engine.rotary_table import use_rotary_table
from engine.sampling import is_greedy, sample
from engine.weights.loader import load_model, pick_device, resolve_source

from .decode import prompt_ids

PARTS = ("layers", "head")
GREEDY = SamplingConfig(temperature=0.0)


def _timed(owner, name: str, spent: dict[str, list[float]], part: str) -> None:
    """Wraps owner.name (an instance attribute from now on) so each call's seconds go to spent[part]."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[part].append(time.perf_counter() - start)

    setattr(owner, name, wrapper)


def load(source, device, compiled: bool):
    model, tokenizer = load_model(source, device, torch.float32, weights="auto")
    use_exact_attention(model)
    if not use_block_forward(model):
        raise SystemExit("bench step: this model does not run under the one-call forward (its weights are not "
                         "all GGUF blocks, or the block kernel is unavailable)")
    if compiled:
        model.model.rotary_emb.forward = torch.compile(model.model.rotary_emb.forward, dynamic=True)
    else:
        use_rotary_table(model)  # as the engine runs it
    return model, tokenizer


@torch.inference_mode()
def run(source=None, device="cpu", prompt_tokens: int = 128, steps: int = 300, compile_too: bool = False,
        sampling: SamplingConfig = GREEDY) -> dict:
    """{row: {"step": median ms, "layers": mean ms, "head": mean ms, "rest": step less the parts, "same": bool}}.
    Each step's token is picked by the engine's sampler (engine.sampling) with `sampling`, seeded alike for every
    row; its time is in the rest."""
    generators = {}

    def pick(name: str, logits: torch.Tensor) -> torch.Tensor:
        generator = None if is_greedy(sampling) else generators.setdefault(name, torch.Generator().manual_seed(0))
        return torch.tensor([[sample(logits[0, -1], sampling, (), generator)]])

    dev = pick_device(device)
    src = resolve_source(source)
    rows = {"eager": load(src, dev, False)}
    if compile_too:
        rows["torch.compile (rotary table)"] = load(src, dev, True)
    ids = prompt_ids(rows["eager"][1], prompt_tokens)
    spent = {name: {part: [] for part in PARTS} for name in rows}
    state = {}
    for name, (model, _) in rows.items():
        _timed(model.forward, "_layers_over", spent[name], "layers")
        _timed(model.model.norm, "forward", spent[name], "head")
        _timed(model.lm_head, "forward", spent[name], "head")
        cache = GrowingCache()
        out = model(input_ids=torch.tensor([ids], device=dev), past_key_values=cache, use_cache=True,
                    logits_to_keep=1)
        state[name] = [cache, pick(name, out.logits)]
    totals = {name: [] for name in rows}
    tokens = {name: [] for name in rows}
    warm = min(20, steps // 4)
    for step in range(warm + steps):
        for name, (model, _) in rows.items():
            if step == warm:
                for part in PARTS:
                    spent[name][part].clear()
            cache, token = state[name]
            start = time.perf_counter()
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            token = pick(name, out.logits)
            if step >= warm:
                totals[name].append(time.perf_counter() - start)
            state[name][1] = token
            tokens[name].append(int(token))
    result = {}
    for name in rows:
        per_step = {part: 1e3 * sum(spent[name][part]) / len(totals[name]) for part in PARTS}
        step_ms = 1e3 * statistics.median(totals[name])
        result[name] = {"step": step_ms, **per_step, "rest": step_ms - sum(per_step.values()),
                        "same": tokens[name] == tokens["eager"]}
    return result


@torch.inference_mode()
def positions_cost(source=None, device="cpu", prompt_tokens: int = 128, counts: Sequence[int] = (1, 2, 3, 5, 9),
                   rounds: int = 60) -> dict[int, dict[str, float]]:
    """{n: {"ms": median ms, "layers": median ms, "head": median ms}} of one forward of n new positions over the
    prompt's cache (a check of n - 1 drafted tokens computes this forward), the cache cropped back after each; the
    counts take turns, so the machine's noise hits them alike. The first 10 rounds warm up."""
    dev = pick_device(device)
    model, tokenizer = load(resolve_source(source), dev, False)
    spent = {part: [] for part in PARTS}
    _timed(model.forward, "_layers_over", spent, "layers")
    _timed(model.model.norm, "forward", spent, "head")
    _timed(model.lm_head, "forward", spent, "head")
    ids = prompt_ids(tokenizer, prompt_tokens)
    cache = GrowingCache()
    model(input_ids=torch.tensor([ids], device=dev), past_key_values=cache, use_cache=True, logits_to_keep=1)
    times = {n: {"ms": [], **{part: [] for part in PARTS}} for n in counts}
    for round_ in range(rounds + 10):
        for n in counts:
            for part in PARTS:
                spent[part].clear()
            new = torch.tensor([ids[-n:]], device=dev)  # any n tokens: the cost does not depend on which
            start = time.perf_counter()
            model(input_ids=new, past_key_values=cache, use_cache=True)
            elapsed = time.perf_counter() - start
            cache.crop(-n)
            if round_ >= 10:
                times[n]["ms"].append(1e3 * elapsed)
                for part in PARTS:
                    times[n][part].append(1e3 * sum(spent[part]))
    return {n: {key: statistics.median(values) for key, values in t.items()} for n, t in times.items()}


def positions_table(result: dict[int, dict[str, float]], prompt_tokens: int) -> str:
    one = result[min(result)]["ms"]
    lines = [f"forwards of n new positions over {prompt_tokens} cached tokens (medians)", "",
             "| positions | ms | cost / one position | layers ms | head ms |", "|---|---|---|---|---|"]
    for n, r in result.items():
        lines.append(f"| {n} | {r['ms']:.2f} | {r['ms'] / one:.2f}x | {r['layers']:.2f} | {r['head']:.2f} |")
    return "\n".join(lines)


def table(result: dict) -> str:
    lines = ["| row | step ms (median) | layers ms (mean) | head ms (mean) | rest ms | tokens as eager |",
             "|---|---|---|---|---|---|"]
    for name, r in result.items():
        lines.append(f"| {name} | {r['step']:.2f} | {r['layers']:.2f} | {r['head']:.2f} | {r['rest']:.2f} | "
                     f"{'yes' if r['same'] else 'NO'} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file or hub name (default: the embedded model)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--compile", action="store_true", help="also the step with its torch parts compiled")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); else sampled")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--positions", default=None,
                        help="instead of decode steps: forwards of these numbers of new positions (comma-separated, "
                             "e.g. 1,2,3,5,9: a check of 4 drafted tokens is 5), as a check or a batch pays them")
    args = parser.parse_args(argv)
    counts = None
    if args.positions is not None:
        try:
            counts = sorted({int(n) for n in args.positions.split(",")})
        except ValueError:
            parser.error(f"--positions: comma-separated counts, got {args.positions!r}")
        if not counts or counts[0] < 1 or counts[-1] > args.prompt_tokens:
            parser.error(f"--positions: counts from 1 to --prompt-tokens ({args.prompt_tokens}), got {args.positions}")
    try:
        sampling = SamplingConfig.from_kwargs(temperature=args.temperature, top_p=args.top_p)
    except ValueError as error:
        parser.error(str(error))
    if args.threads:
        torch.set_num_threads(args.threads)
    if counts is not None:
        print(positions_table(positions_cost(args.model, prompt_tokens=args.prompt_tokens, counts=counts),
                              args.prompt_tokens))
        return 0
    result = run(args.model, prompt_tokens=args.prompt_tokens, steps=args.steps, compile_too=args.compile,
                 sampling=sampling)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
