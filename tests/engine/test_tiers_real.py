"""The KV tiers on the real model: what one engine computed is served from disk to a fresh one (a restart:
the same folder, empty memory), exactly for EXACT hits, and repaired when a file is damaged."""

from __future__ import annotations

import torch

DOC = ("The Harbor Street bakery opens at 6 a.m. on weekdays and 8 a.m. on weekends. Its sourdough is baked "
       "twice a day, and the rye loaf is only sold on Fridays. The owner, Marta Ilves, started the bakery in 1998 "
       "after training in Tallinn. Deliveries to the two cafes on Pier Road leave at 7:15 every morning. ") * 4
OTHER = ("The river ferry runs every 20 minutes between the north and south banks. Bicycles ride free, and the "
         "last crossing leaves the south bank at 11:40 p.m. The ferry was electrified in 2021. ") * 4
QUESTION = "When does the bakery open on weekends?"


def messages(*docs, question=QUESTION):
    return [{"role": "system", "content": "Answer from the documents.\n\n" + "\n\n".join(docs)},
            {"role": "user", "content": question}]


def restart(smollm, folder, **options):
    """A fresh engine on the same folder: empty device and host tiers, the disk tier as left."""
    return smollm.with_options(disk_cache_dir=folder, disk_cache_bytes=None, **options)


def test_after_a_restart_exact_hits_come_from_disk_with_identical_greedy_output(smollm, tmp_path):
    first = restart(smollm, tmp_path, kv_quant="none")
    first.warm(messages(DOC)[:1])
    assert first.cache_stats()["tiers"]["disk"]["writes"] > 0

    second = restart(smollm, tmp_path, kv_quant="none")
    assert second.store.records, "the disk index is read at start"
    result = second.chat(messages(DOC), max_new_tokens=32, return_logits=True)
    cold = smollm.with_options(reuse="off").chat(messages(DOC), max_new_tokens=32, return_logits=True)
    assert result.token_ids == cold.token_ids
    assert torch.allclose(result.first_logits, cold.first_logits, atol=1e-3)
    assert result.stats.reused_by_tier.get("disk", 0) >= 0.8 * result.stats.prompt_tokens
    kinds = {kind for _, _, kind in result.stats.chunks}
    assert "EXACT" in kinds
    stats = second.cache_stats()
    assert stats["tier_hits"]["disk"] >= 1 and stats["promoted"] >= 1
    # promoted: the follow-up reuses the same text from the device tier
    again = second.chat(messages(DOC), max_new_tokens=4)
    assert again.stats.reused_by_tier.get("device", 0) >= result.stats.reused_by_tier["disk"]


def test_after_a_restart_moved_text_is_an_approximate_hit_from_disk(smollm, tmp_path):
    first = restart(smollm, tmp_path, reuse="approx")
    first.warm(messages(DOC)[:1])
    first.warm(messages(OTHER)[:1])
    second = restart(smollm, tmp_path, reuse="approx")
    result = second.chat(messages(OTHER, DOC), max_new_tokens=16)  # DOC now sits after OTHER
    assert any(kind == "APPROXIMATE" for _, _, kind in result.stats.chunks)
    assert result.stats.reused_by_tier.get("disk", 0) > 0
    assert second.cache_stats()["hits"]["APPROXIMATE"] > 0


def test_a_damaged_file_is_recomputed_and_rewritten_after_a_restart(smollm, tmp_path):
    first = restart(smollm, tmp_path, kv_quant="none")
    first.warm(messages(DOC)[:1])
    files = sorted((tmp_path / "payloads").rglob("*.kv"))
    for path in files[:2]:  # damage the first two chunks' files: flip a byte, cut one short
        data = path.read_bytes()
        path.write_bytes(data[:-64] + bytes([data[-64] ^ 0xFF]) + data[-63:])
    files[-1].write_bytes(files[-1].read_bytes()[:100])

    second = restart(smollm, tmp_path, kv_quant="none")
    result = second.chat(messages(DOC), max_new_tokens=24)
    cold = smollm.with_options(reuse="off").chat(messages(DOC), max_new_tokens=24)
    assert result.token_ids == cold.token_ids
    assert second.cache_stats()["disk_misses"] >= 1
    # the damaged chunks were computed again and written anew: a third engine reads every one of them cleanly
    third = restart(smollm, tmp_path, kv_quant="none")
    again = third.chat(messages(DOC), max_new_tokens=24)
    assert again.token_ids == cold.token_ids
    assert third.cache_stats()["disk_misses"] == 0
    assert again.stats.reused_by_tier.get("disk", 0) >= result.stats.reused_by_tier.get("disk", 0)


def test_int8_disk_tier_gives_the_cold_answer_here(smollm, tmp_path):
    first = restart(smollm, tmp_path)  # default kv_quant: int8 on host and disk
    first.warm(messages(DOC)[:1])
    second = restart(smollm, tmp_path)
    result = second.chat(messages(DOC), max_new_tokens=24)
    assert result.stats.reused_by_tier.get("disk", 0) > 0
    # int8 KV is not bit-exact; on this prompt the greedy answer is still the cold one (bench/kv_tiers.py
    # measures agreement and KL over more prompts)
    cold = smollm.with_options(reuse="off").chat(messages(DOC), max_new_tokens=24)
    assert result.token_ids == cold.token_ids


def test_memory_report_lists_every_tier(smollm, tmp_path):
    engine = restart(smollm, tmp_path)
    engine.warm(messages(DOC)[:1])
    report = engine.memory()
    assert set(report["kv_bytes"]) == {"device", "host", "disk"}
    assert report["kv_bytes"]["disk"] > 0 and report["kv_budget_bytes"]["disk"] > 0


def test_a_long_generation_over_the_live_budget_spills_pages_and_matches_an_unbounded_run(smollm):
    config = smollm.model.config
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * \
        (config.hidden_size // config.num_attention_heads) * smollm.model.dtype.itemsize
    bounded = smollm.with_options(live_kv_bytes=48 * per_token, live_page_tokens=32)  # 48 positions on the device
    unbounded = smollm.with_options()
    history = [{"role": "user", "content": "Write a short story about a lighthouse keeper and a storm."}]
    for turn in range(2):
        a = bounded.chat(history, max_new_tokens=80)
        b = unbounded.chat(history, max_new_tokens=80)
        assert a.token_ids == b.token_ids, f"turn {turn}"
        assert a.stats.spilled_tokens > 0 and b.stats.spilled_tokens == 0
        if turn:  # the first turn's KV, stored from the spilled cache, is reused exactly
            assert a.stats.reused_tokens == b.stats.reused_tokens > 0
        history += [{"role": "assistant", "content": a.text}, {"role": "user", "content": "Continue."}]
