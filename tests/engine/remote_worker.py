"""A separate process for the shared-tier tests: the tiny Llama (the same weights, hence the same fingerprint, in
every process) over its own disk folder and a shared Redis store; warms or asks about documents, prints JSON.

    python remote_worker.py URL FOLDER MODE CHUNK KV_QUANT SEED [SEED ...]

MODE: "warm" (prefill the documents, then wait for the shared writes to be sent) or "ask" (a question after
each document, greedy).
"""

from __future__ import annotations

import json
import sys

from disk_worker import NEW_TOKENS, QUESTION, document
from engine import ChunkingConfig, EngineConfig, KVBoost
from engine.config import KVQuantConfig
from tiny_models import build_model, build_tokenizer


def make_engine(url: str, folder: str, chunk: int, quant: str) -> KVBoost:
    config = EngineConfig(chunking=ChunkingConfig(size=chunk), cpu_cache_bytes=0, disk_cache_dir=folder,
                          kv_quant=KVQuantConfig(disk=quant), remote_cache=url)
    return KVBoost(build_model("llama"), build_tokenizer(), config, name="tiny-llama")


def main(argv: list[str]) -> int:
    url, folder, mode, chunk, quant, *seeds = argv
    engine = make_engine(url, folder, int(chunk), quant)
    out = {"answers": {}, "reused_by_tier": {}}
    for seed in seeds:
        if mode == "warm":
            engine.warm(document(int(seed)))
        else:
            result = engine.generate(document(int(seed)) + QUESTION, max_new_tokens=NEW_TOKENS)
            out["answers"][seed] = result.token_ids
            out["reused_by_tier"][seed] = result.stats.reused_by_tier
    out["flushed"] = engine.store.remote.flush(30)
    out["stats"] = engine.cache_stats()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
