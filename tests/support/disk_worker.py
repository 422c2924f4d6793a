"""A separate process for the disk-tier tests. Builds the tiny Llama (the same weights in every process, hence
the same model fingerprint), warms and asks about documents over a shared cache folder, prints JSON.

    python disk_worker.py FOLDER DISK_BUDGET_BYTES KV_QUANT MODE SEED [SEED ...]

MODE: "warm" (prefill the documents), "ask" (a question after each document, greedy), "warm+ask", or
"warm+ask-disk-only" (no device tier: every hit is read from the folder, while the other process evicts), or
"exchange:NAME:PEER" (no device tier: warm the SEEDs before "--", mark NAME as warmed in FOLDER, wait for PEER,
then ask about every SEED, the peer's after "--" included: the peer's documents can only come from its files).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tiny_models import CHUNK, build_model, build_tokenizer, random_ids

from engine import EngineConfig, KVBoost
from engine.config import KVQuantConfig

DOC_TOKENS = 10 * CHUNK
QUESTION = random_ids(7, seed=999)
NEW_TOKENS = 12


def document(seed: int) -> list[int]:
    return random_ids(DOC_TOKENS, seed=seed)


def make_engine(folder: str, budget: int, quant: str, device_bytes: int | None = None) -> KVBoost:
    config = EngineConfig.of(chunk_size=CHUNK, cache_bytes=device_bytes, cpu_cache_bytes=0,
                             disk_cache_dir=folder, disk_cache_bytes=budget, kv_quant=KVQuantConfig(disk=quant))
    return KVBoost(build_model("llama"), build_tokenizer(), config, name="tiny-llama")


def barrier(folder: str, name: str, peer: str, timeout_s: float = 240) -> None:
    """Marks `name` as done and waits until `peer` is too (two processes meet in the folder)."""
    (Path(folder) / f"{name}.warmed").touch()
    deadline = time.monotonic() + timeout_s
    while not (Path(folder) / f"{peer}.warmed").exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{peer} never finished warming")
        time.sleep(0.05)


def exchange(folder: str, budget: int, quant: str, name: str, peer: str, seeds: list[str]) -> dict:
    own, peers = (seeds[:seeds.index("--")], seeds[seeds.index("--") + 1:]) if "--" in seeds else (seeds, [])
    engine = make_engine(folder, budget, quant, 0)
    for seed in own:
        engine.warm(document(int(seed)))
    barrier(folder, name, peer)
    out = {"answers": {}, "reused_by_tier": {}}
    # The peer's documents first, newest first (in warm order, each miss would evict the next one asked about:
    # LRU's sequential-scan pattern); they can only be read from the peer's files.
    for seed in peers[::-1] + own[::-1]:
        result = engine.generate(document(int(seed)) + QUESTION, max_new_tokens=NEW_TOKENS)
        out["answers"][seed] = result.token_ids
        out["reused_by_tier"][seed] = result.stats.reused_by_tier
    out["stats"] = engine.cache_stats().to_dict()
    return out


def main(argv: list[str]) -> int:
    folder, budget, quant, mode, *seeds = argv
    if mode.startswith("exchange:"):
        _, name, peer = mode.split(":")
        print(json.dumps(exchange(folder, int(budget), quant, name, peer, seeds)))
        return 0
    engine = make_engine(folder, int(budget), quant, 0 if mode.endswith("disk-only") else None)
    out = {"answers": {}, "reused_by_tier": {}}
    if mode.startswith("warm"):
        for seed in seeds:
            engine.warm(document(int(seed)))
    for seed in seeds if "ask" in mode else ():
        result = engine.generate(document(int(seed)) + QUESTION, max_new_tokens=NEW_TOKENS)
        out["answers"][seed] = result.token_ids
        out["reused_by_tier"][seed] = result.stats.reused_by_tier
    out["stats"] = engine.cache_stats().to_dict()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
