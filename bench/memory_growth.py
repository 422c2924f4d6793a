"""Resident memory over a run of distinct chats through the OpenAI-compatible server (issue 64: ~1.8 MB a request
over 500 chats, 1329 -> 2222 MB and still growing, was the KV cache filling a default RAM budget nobody saw).

One server in this process on a free loopback port; each request a chat no other shares from its first token, so
each stores chunks of its own. Every --every requests it prints the process's resident size beside what GET
/health says the RAM tiers hold and may hold: the resident size should level off once they are full.

    python -m bench memory-growth       # 500 chats, the default budget (6 s a chat on a shared 2-core CPU)
    python -m bench memory-growth --requests 100 --cpu-cache-bytes 50000000 --cache-bytes 100000000
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORDS = ("harbour ferry island ticket crown pier morning evening market bridge tower lantern captain cargo "
         "river meadow orchard quarry forest valley glacier canyon desert prairie").split()


def distinct_prompt(i: int, num_words: int) -> str:
    return f"Chat {i}: " + " ".join(WORDS[(i * 7 + j * (i % 5 + 1)) % len(WORDS)] for j in range(num_words))


def rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench memory-growth", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--every", type=int, default=25, help="print a row every this many requests")
    p.add_argument("--words", type=int, default=300, help="words in each chat's prompt")
    p.add_argument("--cache-bytes", type=int, default=None, help="the device tier's budget (default: the engine's)")
    p.add_argument("--cpu-cache-bytes", type=int, default=None, help="the host tier's budget (default: the engine's)")
    args = p.parse_args(argv)

    import httpx

    from engine import KVBoost
    from server.app import Timeouts
    from server.thread import ServerThread

    engine = KVBoost.from_pretrained(device="cpu", disk_cache_bytes=0, cache_bytes=args.cache_bytes,
                                     cpu_cache_bytes=args.cpu_cache_bytes)
    server = ServerThread(engine, model_id="bench", timeouts=Timeouts())
    server.start()
    assert server.wait_started(60), "the server did not start"
    try:
        tiers = httpx.get(server.url + "/health", timeout=30).json()["kv_cache"]
        for name, tier in tiers.items():
            print(f"{name}: budget {tier['budget_bytes'] / 2**20:.0f} MB ({tier.get('budget_rule', 'disk')})")
        print(f"{'requests':>8} {'RSS MB':>8} {'RAM KV MB':>9} {'of MB':>7} {'entries':>7} {'s':>6}")
        start = time.perf_counter()
        first_rss = rss_mb()
        for i in range(1, args.requests + 1):
            reply = httpx.post(server.url + "/v1/completions", timeout=300,
                               json={"model": "bench", "prompt": distinct_prompt(i, args.words), "max_tokens": 8,
                                     "temperature": 0})
            reply.raise_for_status()
            if i % args.every == 0 or i == args.requests:
                tiers = httpx.get(server.url + "/health", timeout=30).json()["kv_cache"]
                ram = [t for name, t in tiers.items() if name in ("device", "host")]
                print(f"{i:>8} {rss_mb():>8.0f} {sum(t['bytes'] for t in ram) / 2**20:>9.1f} "
                      f"{sum(t['budget_bytes'] for t in ram) / 2**20:>7.0f} {sum(t['entries'] for t in ram):>7} "
                      f"{time.perf_counter() - start:>6.0f}", flush=True)
        print(f"RSS grew {rss_mb() - first_rss:.0f} MB over {args.requests} requests")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
