"""`python -m bench remote`: a second process restoring a warmed 5-document prompt from the shared KV tier
(Redis/Valkey), against a cold prefill and against its own disk tier.

A warmer process (this module with --warm) loads the model, answers bench.needle's first 5-document question
once with the shared tier on (its chunks go to the store) and waits until they are sent. Then this process, with
the same model, answers the same prompt `--trials` times each way, greedy:

- remote: an engine whose memory and disk tiers start empty (a fresh folder per trial): every document chunk
  comes from the store;
- disk:   an engine over the folder the first remote trial filled (what came from the store was written through
  to it), without the store: every document chunk is read from its own disk;
- cold:   reuse off, the whole prompt computed.

TTFT is the median over the trials; bytes read are what the tier handed over for one answer. Without --remote-cache
a private redis-server is started on a free loopback port (no persistence) and stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch

from bench import needle
from bench.results import markdown_table


def prompt() -> list[dict]:
    docs = needle.make_documents()
    return needle.messages_for(docs, needle.make_questions(docs, 1, docs_per_prompt=5)[0])


def load(args, **options):
    from engine import KVBoost

    return KVBoost.from_pretrained(args.model, device="cpu", weights=args.weights, quiet=True, cpu_cache_bytes=0,
                                   **options)


def warm(args) -> int:
    """The first machine: computes the prompt once with the shared tier on and waits for its writes."""
    engine = load(args, disk_cache_dir=args.warm_dir, remote_cache=args.remote_cache)
    result = engine.chat(prompt(), max_new_tokens=args.new_tokens)
    flushed = engine.store.remote.flush(60)
    print(json.dumps({"flushed": flushed, "ttft_ms": result.stats.ttft_ms,
                      "written_bytes": engine.store.remote.counters.written_bytes}))
    return 0


def start_store(folder: Path) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("bench remote: no redis-server here; install it (apt-get install redis-server) or pass "
                         "--remote-cache URL")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(folder)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    client = redis.Redis(host="127.0.0.1", port=port)
    for _ in range(200):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    client.close()
    return proc, f"redis://127.0.0.1:{port}/0"


def answer(engine, max_new_tokens: int):
    return engine.chat(prompt(), max_new_tokens=max_new_tokens)


def measure(args, url: str, work: Path) -> list[dict]:
    base = load(args, reuse="off", disk_cache_bytes=0)
    rows = {"cold": [], "remote": [], "disk": []}
    read = {"cold": 0, "remote": 0, "disk": 0}
    texts = {}
    answer(base, 1)  # one-time costs of a first forward
    for trial in range(args.trials):
        result = answer(base, args.new_tokens)
        rows["cold"].append(result.stats.ttft_ms)
        texts.setdefault("cold", result.token_ids)
        shared = base.with_options(reuse="chunk", disk_cache_dir=str(work / f"own-{trial}"), disk_cache_bytes=None,
                                   remote_cache=url)
        result = answer(shared, args.new_tokens)
        rows["remote"].append(result.stats.ttft_ms)
        texts.setdefault("remote", result.token_ids)
        read["remote"] = shared.store.remote.counters.read_bytes
        assert result.stats.reused_by_tier.get("remote", 0) > 0, f"nothing came from the store: {result.stats}"
        shared.store.remote.close()
        own = base.with_options(reuse="chunk", disk_cache_dir=str(work / "own-0"), disk_cache_bytes=None)
        result = answer(own, args.new_tokens)
        rows["disk"].append(result.stats.ttft_ms)
        texts.setdefault("disk", result.token_ids)
        read["disk"] = own.store.disk.counters.read_bytes
        own.store.disk.close()
    cold = statistics.median(rows["cold"])
    return [{"path": name, "ttft_ms": statistics.median(times), "vs_cold": cold / statistics.median(times),
             "bytes_read": read[name], "greedy_identical": texts[name] == texts["cold"],
             "prompt_tokens": len(base.encode(prompt()))}
            for name, times in rows.items()]


def table(rows: list[dict]) -> str:
    return markdown_table(["path", "TTFT ms (median)", "vs cold", "bytes read", "greedy identical"],
                          [[r["path"], f"{r['ttft_ms']:.0f}", f"{r['vs_cold']:.1f}x",
                            f"{r['bytes_read'] / 2**20:.1f} MB" if r["bytes_read"] else "-",
                            "yes" if r["greedy_identical"] else "NO"] for r in rows])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench remote", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--weights", default="auto", choices=("auto", "float", "int4"))
    parser.add_argument("--remote-cache", default=None, help="the store (default: a private redis-server)")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's choice)")
    parser.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--warm-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="also print the rows as JSON")
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.warm:
        return warm(args)
    with tempfile.TemporaryDirectory(prefix="bench-remote-") as tmp:
        work = Path(tmp)
        proc, url = (None, args.remote_cache) if args.remote_cache else start_store(work)
        try:
            warmer = [sys.executable, "-m", "bench.remote", "--warm", "--warm-dir", str(work / "warmer"),
                      "--remote-cache", url, "--weights", args.weights, "--new-tokens", str(args.new_tokens),
                      "--threads", str(args.threads), *(["--model", args.model] if args.model else [])]
            done = subprocess.run(warmer, capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:
                raise SystemExit(f"bench remote: the warmer failed:\n{done.stderr[-3000:]}")
            warmed = json.loads(done.stdout.strip().splitlines()[-1])
            rows = measure(args, url, work)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(10)
    print(f"prompt: {rows[0]['prompt_tokens']} tokens (bench.needle, 5 documents); the warmer wrote "
          f"{warmed['written_bytes'] / 2**20:.1f} MB; threads: {torch.get_num_threads()}")
    print(table(rows))
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
