"""A fresh process for the restart test: the real default model with every setting at its default (the disk
folder from $KVBOOST_CACHE_DIR), a multi-turn greedy chat, its tokens and reuse stats printed as JSON.

    python chat_worker.py
"""

from __future__ import annotations

import json
import sys

QUESTIONS = (
    "What is the capital of France? Answer in one sentence.",
    "And what river runs through it?",
    "Name two famous museums there.",
    "Which of them is older?",
)
NEW_TOKENS = 48
SYSTEM = "You are a concise assistant. Answer briefly and factually."


def conversation(answer):
    """Runs the chat with `answer(messages) -> (text, token_ids, stats)`; returns the turns."""
    messages = [{"role": "system", "content": SYSTEM}]
    turns = []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        text, token_ids, stats = answer(messages)
        messages.append({"role": "assistant", "content": text})
        turns.append({"token_ids": token_ids, **stats})
    return turns


def main() -> int:
    from cli.kvboost import quiet_transformers
    from engine import KVBoost

    quiet_transformers()
    engine = KVBoost.from_pretrained(device="cpu")  # the defaults a user gets

    def answer(messages):
        result = engine.chat(messages, max_new_tokens=NEW_TOKENS)
        return result.text, result.token_ids, {"chunks": result.stats.chunks,
                                               "reused_by_tier": result.stats.reused_by_tier}

    turns = conversation(answer)
    stats = engine.cache_stats().to_dict()  # printed as JSON for the test that runs this process
    print(json.dumps({"turns": turns, "hits": stats["hits"],
                      "kv_quant": {name: tier["kv_quant"] for name, tier in stats["tiers"].items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
