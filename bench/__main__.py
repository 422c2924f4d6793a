"""`python -m bench COMMAND [ARGS]`: every benchmark behind one entry (`kvboost bench` runs this). `python -m bench`
alone, or with reuse workload names (multiturn, sysprompt, rag, needle, all), runs the side-by-side reuse benchmark;
`python -m bench --help` lists the commands; `python -m bench COMMAND --help` shows one's options."""

from __future__ import annotations

import importlib
import sys
from typing import Sequence

# name -> (module whose main(argv) runs it, what it measures). One table: --help, dispatch and the docs' list.
COMMANDS: dict[str, tuple[str, str]] = {
    "reuse": ("bench.reuse", "TTFT of the reuse modes side by side: multiturn, sysprompt, rag, needle (the default)"),
    "decode": ("bench.decode", "weight formats side by side: prefill, decode, the bandwidth roofline, llama.cpp"),
    "shapes": ("bench.shapes", "a real model's shape (1.5b, 7b; random weights) against llama.cpp on the same file"),
    "step": ("bench.step", "where a decode step's time goes (the C call, the head, the rest); --compile too"),
    "kernels": ("bench.kernels", "the C kernels by rows at once: a check's or a batch's cost against one token"),
    "exactness": ("bench.exactness", "greedy answers with EXACT/PREFIX hits against uncached ones, per weight format"),
    "rounding": ("bench.rounding", "greedy answers with activations rounded to int8 or int16 per 32, against float"),
    "streaming": ("bench.streaming", "int4 layer streaming against the resident model"),
    "speculative": ("bench.speculative", "prompt-lookup speculative decoding against one token per forward"),
    "batching": ("bench.batching", "concurrent streams through the server, one at a time against batched"),
    "remote": ("bench.remote", "a second process restoring a warmed prompt from the shared KV tier (Redis/Valkey)"),
    "kv-tiers": ("bench.kv_tiers", "restart from the disk tier, eviction policies, memory and quality per kv_quant"),
    "server": ("bench.server", "TTFT through the OpenAI-compatible server, reuse on and off, concurrent streams"),
    "memory-growth": ("bench.memory_growth", "resident memory over 500 distinct chats beside the RAM tiers' fill"),
    "approx-curve": ("bench.approx_curve", "needle accuracy and KL as approximate reuse recomputes more (0-100%)"),
    "rag-session": ("bench.rag_session", "a 5-question chat over dropped documents, as the app lays it out"),
    "gpu": ("bench.gpu_check", "on a CUDA device: int4 kernels, CUDA graphs, the engine's roofline, streaming"),
}
REUSE_WORKLOADS = ("multiturn", "sysprompt", "rag", "needle", "all")


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: python -m bench COMMAND [ARGS]   (kvboost bench COMMAND [ARGS] is the same)", "",
             "commands:"]
    lines += [f"  {name.ljust(width)}  {about}" for name, (_, about) in COMMANDS.items()]
    lines += ["", f"With no command, or with reuse workloads ({', '.join(REUSE_WORKLOADS)}) first, it runs 'reuse'.",
              "python -m bench COMMAND --help shows that command's options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"], ["help"]):
        print(usage())
        return 0
    if not args or args[0] in REUSE_WORKLOADS or args[0].startswith("-"):
        args = ["reuse", *args]
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"python -m bench: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return module.main(rest)


if __name__ == "__main__":
    sys.exit(main())
