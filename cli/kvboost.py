"""`kvboost`: chat, run, warm and bench over the engine. argparse -> config -> engine, nothing more."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import subprocess
import sys
from pathlib import Path

from engine.config import SamplingConfig, help_of, options
from engine.reports import CacheStats
from engine.version import version


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """--model, one flag per load and engine option (engine.config.options(): its flat name, default, allowed
    values and help; older spellings kept as aliases), and --threads."""
    p.add_argument("--model", default=None,
                   help="model folder, .gguf file or HF hub id in the local cache (default: embedded SmolLM2-135M)")
    for opt in options().values():
        flags = ["--" + opt.name.replace("_", "-"), *opt.flags]
        kind = _kind(opt)
        help_text = (opt.help + ("" if opt.default is None or kind is bool else f" (default: {opt.default})")
                     ).replace("%", "%%")  # argparse formats help with %
        if kind is bool:
            p.add_argument(*flags, dest=opt.name, action=argparse.BooleanOptionalAction, default=opt.default,
                           help=help_text)
            continue
        choices = opt.choices
        if choices is not None and None in choices:  # None is spelled "off" (engine_options reads it back)
            choices = tuple("off" if c is None else c for c in choices)
        p.add_argument(*flags, dest=opt.name, type=kind,
                       default=opt.default, choices=choices, help=help_text,
                       metavar=None if choices else _metavar(opt.name))
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")


_METAVARS = {"s": "SECONDS", "cache": "URL", "model": "SOURCE"}  # by the option name's last word


def _metavar(name: str) -> str:
    last = name.rsplit("_", 1)[-1]
    return _METAVARS.get(last, last.upper())


def _kind(opt):
    """The command-line type of an option, from its field's annotation ("int | None" -> int)."""
    if opt.choices:
        return type(next(c for c in opt.choices if c is not None))
    annotation = opt.field.type if isinstance(opt.field.type, str) else opt.field.type.__name__
    return {"int": int, "float": float, "bool": bool}.get(annotation.split("|")[0].strip(), str)


def engine_options(args) -> dict:
    """The load and engine options of parsed arguments (add_engine_options), by their flat names."""
    table = options()
    return {name: None if getattr(args, name) == "off" and None in (opt.choices or ()) else getattr(args, name)
            for name, opt in table.items()}


def _add_sampling_options(p: argparse.ArgumentParser) -> None:
    defaults = SamplingConfig()
    p.add_argument("--max-new-tokens", type=int, default=256, help=help_of(SamplingConfig, "max_new_tokens"))
    for name, kind in (("temperature", float), ("top_p", float), ("top_k", int), ("repetition_penalty", float),
                       ("seed", int)):
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=getattr(defaults, name),
                       help=help_of(SamplingConfig, name))
    p.add_argument("--stop", action="append", default=None, help=help_of(SamplingConfig, "stop") + " (repeatable)")


def _sampling(args) -> dict:
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                top_k=args.top_k, repetition_penalty=args.repetition_penalty, seed=args.seed, stop=args.stop)


def load_engine(args):
    """The engine the parsed engine options (add_engine_options) describe."""
    from engine.engine import KVBoost

    if not getattr(args, "verbose", False):
        quiet_transformers()  # here, not in main: commands that load no model start without torch
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    print("loading model ...", file=sys.stderr, flush=True)
    from engine.weights.weights_report import describe_weights

    engine = KVBoost.from_pretrained(args.model, progress=_LoadProgress(sys.stderr), **engine_options(args))
    print(f"loaded {engine.name}: {describe_weights(engine.info().weights)}", file=sys.stderr, flush=True)
    return engine


class _LoadProgress:
    """The load's steps on stderr: one line rewritten in place on a terminal, else a line per tenth."""

    def __init__(self, out):
        self.out, self.tty, self.shown = out, out.isatty(), -1

    def __call__(self, done: int, total: int, what: str) -> None:
        if total <= 0:
            return
        if self.tty:
            end = "\n" if done >= total else ""
            self.out.write(f"\r  {what} ({done}/{total})\x1b[K{end}")
        elif done * 10 // total > self.shown:
            self.shown = done * 10 // total
            self.out.write(f"  {what} ({done}/{total})\n")
        self.out.flush()


def _badge(stats) -> str:
    return (f"[{stats.prompt_tokens} prompt tokens, {stats.reused_fraction:.0%} reused, "
            f"TTFT {stats.ttft_ms:.0f} ms, {stats.decode_tokens_per_s:.1f} tok/s]")


def _stream_to(out, eng, prompt, sampling, cancel=None, status=None, lead: str = ""):
    """Writes `lead`, then the answer, to `out` as it comes, and returns the Result. A long prompt is read in
    pieces: on a terminal (`status`, by default stderr where it is one) one line says how far, rewritten after each
    piece and erased before `lead` and the first token, so they start where they would have."""
    from engine import PromptProgress, Result

    status = status if status is not None else (sys.stderr if sys.stderr.isatty() else None)
    result, shown = None, False

    def begin():
        nonlocal shown, lead
        if shown:  # the line goes before anything else is written
            status.write("\r\x1b[K")
            status.flush()
            shown = False
        if lead:
            out.write(lead)
            out.flush()
            lead = ""

    try:
        for event in eng.stream(prompt, cancel=cancel, progress=status is not None, **sampling):
            if isinstance(event, PromptProgress):
                status.write(f"\r  reading the prompt: {event.done} of {event.total} tokens "
                             f"({event.done * 100 // event.total}%)\x1b[K")
                status.flush()
                shown = True
                continue
            begin()
            if isinstance(event, Result):
                result = event
            else:
                out.write(event.text)
                out.flush()
    finally:  # also stopped (Ctrl-C) or failed while reading: what follows starts on a clean line, after `lead`
        begin()
    return result


def cmd_run(args) -> int:
    eng = load_engine(args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.chat:
        prompt = [{"role": "user", "content": prompt}]
    result = _stream_to(sys.stdout, eng, prompt, _sampling(args))
    print()
    print(_badge(result.stats), file=sys.stderr)
    if args.json:
        print(json.dumps({"text": result.text, "finish_reason": result.finish_reason,
                          "stats": result.stats.to_dict()}), file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    from .chat import run_chat

    return run_chat(load_engine(args), args.system, _sampling(args), _stream_to, _badge, stats_summary,
                    temporary=args.temporary)


def stats_summary(stats: CacheStats) -> str:
    """cache_stats() in a few lines: what is cached, where, and how often it was reused."""
    lines = [f"cache: {stats.entries} entries, {stats.tokens} tokens, {_human(stats.bytes)} in memory "
             f"(reuse {stats.reuse}, chunks of {stats.chunking.size} tokens)",
             f"reused {sum(stats.hits.values())} times, missed {stats.misses}, stored {stats.stored}, "
             f"evicted {stats.evicted}"]
    tiers = stats.tiers
    for name, tier in (("device", tiers.device), ("host", tiers.host), ("disk", tiers.disk)):  # (remote: no entries)
        if tier is None:
            continue
        of = f" of {_human(tier.budget_bytes)}" if tier.budget_bytes else ""
        rule = f" ({tier.budget_rule})" if getattr(tier, "budget_rule", None) else ""
        lines.append(f"  {name}: {tier.entries} entries, {_human(tier.bytes)}{of}{rule}"
                     f"{', kv ' + tier.kv_quant if tier.kv_quant != 'none' else ''}")
    if stats.disk_error:
        lines.append(f"  disk: {stats.disk_error}")
    return "\n".join(lines)


def cmd_warm(args) -> int:
    """Each file's text (read as the app reads a dropped file: its formats, in a worker process with time and
    memory limits; "-": stdin, up to the same size) prefilled into the cache. A file that cannot be read or is
    longer than the model holds is named with the reason and the others are still warmed: exit code 1."""
    from app.document_worker import shared_pool
    from app.documents import MAX_FILE_BYTES, DocumentError

    eng = load_engine(args)
    failed = 0
    for name in args.files:
        try:
            if name == "-":
                text = sys.stdin.read(MAX_FILE_BYTES + 1)
                if len(text) > MAX_FILE_BYTES:
                    raise ValueError(f"standard input is over {_human(MAX_FILE_BYTES)}; warm files of at most that")
            else:
                text = shared_pool().extract(name).text
            info = eng.warm(text)
        except DocumentError as exc:  # its message names the file
            print(f"kvboost warm: {exc}", file=sys.stderr)
            failed += 1
            continue
        except ValueError as exc:  # longer than the model holds
            print(f"kvboost warm: {name}: {exc}", file=sys.stderr)
            failed += 1
            continue
        print(f"{name}: {info['tokens']} tokens, {info['entries_stored']} entries stored in {info['ms']:.0f} ms")
    print(json.dumps(eng.cache_stats().to_dict()))
    return 1 if failed else 0


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def cmd_cache(args) -> int:
    """The disk KV tier, without loading a model: stats (read-only, without torch: at once), clear, verify; stats
    also of a shared store (--remote-cache)."""
    from engine.kv.disk_maintenance import INDEX_FILENAME, default_cache_dir, read_stats

    folder = Path(args.dir).expanduser() if args.dir else default_cache_dir()
    if args.action == "stats":
        import sqlite3

        try:
            stats = read_stats(folder) or {}
        except sqlite3.Error as exc:  # not an index (a damaged or foreign file): said, not a traceback
            print(f"kvboost: the disk KV cache index in {folder} cannot be read: {exc}", file=sys.stderr)
            return 1
        if args.remote_cache:
            return _remote_stats(args, stats)
        if not stats:
            print(f"no disk KV cache in {folder}")
        elif args.json:
            print(json.dumps(stats, indent=2))
        else:
            _print_disk_stats(stats)
        if not args.json:
            _print_ram_budget()
        return 0
    if args.action != "clear" and not (folder / INDEX_FILENAME).exists():
        print(f"no disk KV cache in {folder}")
        return 0
    from engine.kv.disk import DiskTier

    disk = DiskTier(folder, budget_bytes=0)
    try:
        if args.action == "clear":
            print(f"removed {disk.clear()} entries from {folder}")
        else:
            report = disk.verify(repair=not args.dry_run)
            for bad in report["bad"]:
                print(f"bad: {bad['file']}: {bad['problem']}")
            verb = "found" if args.dry_run else "removed"
            print(f"checked {report['checked']} entries: {len(report['bad'])} bad ({verb}), "
                  f"{len(report['orphans_removed'])} orphan files removed")
            return 1 if report["bad"] and args.dry_run else 0
    finally:
        disk.close()
    return 0


def _print_ram_budget() -> None:
    """The RAM tiers beside the disk tier: they live in the process that runs a model, so this says their default
    budget on this machine (engine.ram_budget.default_ram_budget) and where their fill is shown."""
    from engine.ram_budget import machine_ram_budget

    ram = machine_ram_budget()
    print(f"RAM tiers: {_human(ram.bytes)} budget (default: {ram.rule}; --cpu-cache-bytes and --cache-bytes set it), "
          "filled only while a model runs: /stats in kvboost chat, GET /health on kvboost-server")


def _print_disk_stats(stats: dict) -> None:
    print(f"{stats['folder']}: {stats['entries']} entries, {_human(stats['bytes'])} on disk "
          f"({_human(stats['raw_bytes'])} as computed), {stats['tokens']} tokens")
    for ns in stats["namespaces"]:
        settings = ", ".join(f"{k}={v}" for k, v in ns["settings"].items())
        print(f"  {ns['model']} [{settings}]: {ns['entries']} entries, {_human(ns['bytes'])}, "
              f"{ns['tokens']} tokens")


def _remote_stats(args, disk_stats: dict) -> int:
    """The disk tier's stats (when there is a folder) and the shared store's."""
    import redis

    from engine.kv.remote_maintenance import report

    try:
        remote = report(args.remote_cache)
    except (redis.RedisError, OSError) as exc:
        print(f"kvboost: the shared KV store {args.remote_cache.rsplit('@', 1)[-1]} cannot be read: {exc}",
              file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({**disk_stats, "remote": remote}, indent=2))
        return 0
    if disk_stats:
        _print_disk_stats(disk_stats)
    limit = f" of maxmemory {_human(remote['maxmemory'])}" if remote["maxmemory"] else " (no maxmemory set)"
    print(f"{remote['url']}: {remote['entries']} entries, {_human(remote['bytes'])} of KV; the store uses "
          f"{_human(remote['used_memory'] or 0)}{limit}, policy {remote['maxmemory_policy']}, "
          f"{remote['evicted_keys']} keys evicted")
    if remote["maxmemory_policy"] and not str(remote["maxmemory_policy"]).startswith("allkeys-"):
        print("  note: with this policy a full store refuses writes instead of evicting old KV "
              "(docs/guide/shared-tier.md: maxmemory-policy allkeys-lru)")
    for ns in remote["namespaces"]:
        settings = ", ".join(f"{k}={v}" for k, v in ns["settings"].items())
        print(f"  {ns['model']} [{settings}]: {ns['entries']} entries, {_human(ns['bytes'])}")
    return 0


def cmd_bench(args) -> int:
    """`python -m bench ARGS` in a child process: the benchmarks are the bench package beside the engine, which
    the engine never imports."""
    if importlib.util.find_spec("bench") is None:
        print("kvboost bench: the bench package is not installed (it ships with the source checkout)",
              file=sys.stderr)
        return 2
    try:
        return subprocess.call([sys.executable, "-m", "bench", *args.bench_args])
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvboost", description="Local LLM inference that never computes the "
                                     "same text twice.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the engine does (INFO)")
    parser.add_argument("--version", action="version", version=f"kvboost {version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("chat", help="interactive chat in the terminal")
    add_engine_options(p)
    _add_sampling_options(p)
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--temporary", action="store_true", help="keep nothing: the conversations are otherwise kept "
                   "in the desktop app's database (its data folder: $KVBOOST_HOME/data, else the per-user one)")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("run", help="one prompt, streamed to stdout")
    add_engine_options(p)
    _add_sampling_options(p)
    p.add_argument("prompt", help="the prompt text, or - to read stdin")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message (chat template)")
    p.add_argument("--json", action="store_true", help="also print the result and stats as JSON on stderr")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("warm", help="prefill files into the cache and report")
    add_engine_options(p)
    p.add_argument("files", nargs="+")
    p.set_defaults(func=cmd_warm)

    p = sub.add_parser("cache", help="the persistent disk KV tier: stats | clear | verify")
    p.add_argument("action", choices=("stats", "clear", "verify"))
    p.add_argument("--dir", default=None, help="cache folder (default: the per-user one, or $KVBOOST_CACHE_DIR)")
    p.add_argument("--json", action="store_true", help="stats as JSON")
    p.add_argument("--dry-run", action="store_true", help="verify: report bad entries without removing them "
                   "(exit 1 when there are any)")
    p.add_argument("--remote-cache", default=None, metavar="URL",
                   help="stats: also the shared Redis/Valkey KV store at URL (entries per model and setting)")
    p.set_defaults(func=cmd_cache)

    p = sub.add_parser("bench", help="the benchmarks (python -m bench; kvboost bench --help lists them)",
                       add_help=False)
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_bench)

    from .models import add_models_parser  # kvboost models search | files | download | list | remove
    add_models_parser(sub)
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # everything after it is the bench's own (its --help too)
        return cmd_bench(argparse.Namespace(bench_args=argv[1:]))
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    try:
        return args.func(args)
    except ValueError as exc:  # engine.ModelLoadError among them
        print(f"kvboost: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def quiet_transformers() -> None:
    """engine.weights.loader.quiet_transformers, imported when called (the CLI starts without torch)."""
    from engine.weights.loader import quiet_transformers as quiet

    quiet()


if __name__ == "__main__":
    sys.exit(main())
