"""A separate process for the shared-tier tests: a tiny Llama (the same weights, hence the same fingerprint, in
every process) over its own disk folder and a shared Redis store; warms or asks about documents, prints JSON.

    python remote_worker.py URL FOLDER MODE CHUNK KV_QUANT SEED [SEED ...] [--model wide] [--silence S]

MODE: "warm" (prefill the documents, then wait for the shared writes to be sent) or "ask" (a question after
each document, greedy). --model wide: a Llama as small to compute but with 128 KB of KV per token (16 layers of
8 KV heads of 128 dims), so that its documents (WIDE_DOC_TOKENS) are tens of MB in the store. --silence S: the
shared tier's silence limit (remote_timeout_s), default the engine's.
"""

from __future__ import annotations

import json
import sys

import torch
from disk_worker import NEW_TOKENS, QUESTION, document
from tiny_models import COMMON, build_model, build_tokenizer, random_ids

from engine import EngineConfig, KVBoost
from engine.config import KVQuantConfig

WIDE_CHUNK = 64
WIDE_DOC_TOKENS = 6 * WIDE_CHUNK  # 48 MB of float32 KV


def build_wide_model():
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**dict(COMMON, num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=8,
                                head_dim=128))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()


def make_engine(url: str, folder: str, chunk: int, quant: str, model: str = "tiny",
                silence_s: float | None = None) -> KVBoost:
    timing = {} if silence_s is None else {"remote_timeout_s": silence_s}
    config = EngineConfig.of(chunk_size=chunk, cpu_cache_bytes=0, disk_cache_dir=folder,
                             kv_quant=KVQuantConfig(disk=quant), remote_cache=url, **timing)
    weights = build_wide_model() if model == "wide" else build_model("llama")
    return KVBoost(weights, build_tokenizer(), config, name=f"{model}-llama")


def main(argv: list[str]) -> int:
    model = "tiny"
    if "--model" in argv:
        at = argv.index("--model")
        model = argv[at + 1]
        argv = argv[:at] + argv[at + 2:]
    silence = None
    if "--silence" in argv:
        at = argv.index("--silence")
        silence = float(argv[at + 1])
        argv = argv[:at] + argv[at + 2:]
    url, folder, mode, chunk, quant, *seeds = argv
    if model == "wide":
        torch.set_num_threads(1)
    engine = make_engine(url, folder, int(chunk), quant, model, silence)
    out = {"answers": {}, "reused_by_tier": {}}
    for seed in seeds:
        doc = random_ids(WIDE_DOC_TOKENS, seed=int(seed)) if model == "wide" else document(int(seed))
        if mode == "warm":
            engine.warm(doc)
        else:
            result = engine.generate(doc + QUESTION, max_new_tokens=NEW_TOKENS)
            out["answers"][seed] = result.token_ids
            out["reused_by_tier"][seed] = result.stats.reused_by_tier
    out["flushed"] = engine.store.remote.flush(30)
    out["stats"] = engine.cache_stats().to_dict()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
