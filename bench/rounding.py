"""`python -m bench rounding`: what rounding the activations does to a model's answers, int8 against int16 per 32
values, next to the float answers of the same weights.

The block kernel multiplies a 32-value type's weights (Q4_0, Q4_1, Q8_0) by activations rounded per 32 values to
int16 (engine/weights/gguf_blocks.c); llama.cpp, and this kernel for the K-quants, round to int8. int8 products
run up to twice as fast here (`python -m bench kernels --type Q4_K` against Q4_1), so this is the measure of what
that speed would cost. The model is loaded with its weights dequantized to float32 (weights="float": the file's
values), and every linear's input, the head's included, is rounded per 32 values to the codes of that width and
back (scale = max|x| / 127 or / 32767, nearest code, ties to even) before it is multiplied, in PyTorch. That is
the kernel's rounding of the activations, not its arithmetic: the float sums run in PyTorch's order, so this
measures what the rounding changes and nothing else.

Greedy answers to the questions below (chat template, `--tokens` new tokens), each rounding against float: the
answers that differ are printed, then how many of each are the same as float's.

    python -m bench rounding                       # the embedded model
    python -m bench rounding --model FILE.gguf --tokens 48
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

QUESTIONS = ("What is the capital of France?", "Who wrote Romeo and Juliet?", "What is 2 + 2?",
             "Name 3 animals that live in the sea.", "Give 3 tips for sleeping well.",
             "What is the boiling point of water in Celsius?", "Translate 'good morning' into Spanish.",
             "What is the largest planet in the solar system?")
WIDTHS = {"int16": 32767.0, "int8": 127.0}
GROUP = 32


def rounded(x: torch.Tensor, top: float) -> torch.Tensor:
    """x with each run of GROUP values along its last dimension rounded to codes of -top..top times that run's
    scale (max|x| / top; an all-zero run stays zero)."""
    runs = x.to(torch.float32).reshape(-1, x.shape[-1] // GROUP, GROUP)
    scale = runs.abs().amax(dim=-1, keepdim=True) / top
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.round(runs / safe) * scale).reshape(x.shape).to(x.dtype)


def answers(engine, questions, tokens: int, top: float | None) -> list[str]:
    """The greedy answers with every linear's input rounded to codes of -top..top (None: as it is)."""
    hooks = []
    if top is not None:
        for module in engine.model.modules():
            if isinstance(module, torch.nn.Linear) and module.in_features % GROUP == 0:
                hooks.append(module.register_forward_pre_hook(
                    lambda _module, args: (rounded(args[0], top), *args[1:])))
    try:
        out = []
        for question in questions:
            ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=True,
                                                       add_generation_prompt=True, return_dict=True)["input_ids"]
            with torch.inference_mode():
                made = engine.model.generate(torch.tensor([list(ids)]), max_new_tokens=tokens, do_sample=False)
            out.append(engine.tokenizer.decode(made[0, len(ids):], skip_special_tokens=True))
        return out
    finally:
        for hook in hooks:
            hook.remove()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench rounding", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file or hub name (default: the embedded model)")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per answer")
    args = parser.parse_args(argv)
    if args.tokens < 1:
        parser.error("--tokens must be at least 1")
    from cli.kvboost import quiet_transformers
    from engine import KVBoost

    quiet_transformers()
    engine = KVBoost.from_pretrained(args.model, device="cpu", disk_cache_bytes=0, weights="float", quiet=True)
    print(f"# Activations rounded per {GROUP} ({Path(engine.name).name}, its weights as float32, greedy, "
          f"{args.tokens} new tokens, {len(QUESTIONS)} questions)\n")
    reference = answers(engine, QUESTIONS, args.tokens, None)
    same = {}
    for name, top in WIDTHS.items():
        got = answers(engine, QUESTIONS, args.tokens, top)
        same[name] = sum(a == b for a, b in zip(got, reference))
        for question, want, have in zip(QUESTIONS, reference, got):
            if have != want:
                print(f"- {name}, {question!r}:\n  float: {want!r}\n  {name}: {have!r}")
    print("\n| activations | answers the same as float |\n|---|---|")
    for name in WIDTHS:
        print(f"| {name} per {GROUP} | {same[name]}/{len(QUESTIONS)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
