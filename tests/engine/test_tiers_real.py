"""The KV tiers on the real model: what one engine computed is served from disk to a fresh one (a restart:
the same folder, empty memory). A lossless disk tier (kv_quant "none", the default) gives back the KV it was
written bit for bit, so requests served from disk, EXACT or APPROXIMATE, are bit-identical to the same requests
served from memory; a damaged file is recomputed and rewritten."""

from __future__ import annotations

import torch
from quality import common_prefix, kl

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


def in_memory(smollm, *texts, **options):
    """An engine without a disk tier that warmed the same texts: the same entries, served from memory."""
    engine = smollm.with_options(disk_cache_bytes=0, kv_quant="none", **options)
    for text in texts:
        engine.warm(text)
    return engine


def test_after_a_restart_exact_hits_come_from_disk_bit_identical_to_memory(smollm, tmp_path):
    first = restart(smollm, tmp_path, kv_quant="none")
    first.warm(messages(DOC)[:1])
    assert first.cache_stats().tiers.disk.writes > 0
    written = {key: first.store.payload(key) for key, r in first.store.records.items() if r.tier == "device"}
    assert written

    second = restart(smollm, tmp_path, kv_quant="none")
    assert second.store.records, "the disk index is read at start"
    result = second.chat(messages(DOC), max_new_tokens=32, return_logits=True)
    assert result.stats.reused_by_tier.get("disk", 0) >= 0.8 * result.stats.prompt_tokens
    kinds = {kind for _, _, kind in result.stats.chunks}
    assert "EXACT" in kinds and "QUANTIZED" not in kinds
    stats = second.cache_stats()
    assert stats.tier_hits["disk"] >= 1 and stats.promoted >= 1
    # a lossless payload file gives back exactly the KV that was written
    promoted = [key for key in written if key in second.store.records and second.store.records[key].tier == "device"]
    assert len(promoted) >= 1
    for key in promoted:
        for (k, v), (k0, v0) in zip(second.store.payload(key), written[key], strict=True):
            assert torch.equal(k, k0) and torch.equal(v, v0)
    # so the request is the one served from memory, bit for bit
    memory = in_memory(smollm, messages(DOC)[:1])
    from_memory = memory.chat(messages(DOC), max_new_tokens=32, return_logits=True)
    assert from_memory.stats.chunks == result.stats.chunks
    assert torch.equal(result.first_logits, from_memory.first_logits)
    assert result.token_ids == from_memory.token_ids
    # and the answer of a full prefill (the same maths in other kernel shapes: close, not bit-equal)
    cold = smollm.with_options(reuse="off").chat(messages(DOC), max_new_tokens=32, return_logits=True)
    assert result.token_ids == cold.token_ids
    assert torch.allclose(result.first_logits, cold.first_logits, atol=1e-3)
    # promoted: the follow-up reuses the same text from the device tier
    again = second.chat(messages(DOC), max_new_tokens=4)
    assert again.stats.reused_by_tier.get("device", 0) >= result.stats.reused_by_tier["disk"]


def test_after_a_restart_moved_text_is_an_approximate_hit_from_disk_served_as_from_memory(smollm, tmp_path):
    first = restart(smollm, tmp_path, reuse="approx", kv_quant="none")
    first.warm(messages(DOC)[:1])
    first.warm(messages(OTHER)[:1])
    second = restart(smollm, tmp_path, reuse="approx", kv_quant="none")
    result = second.chat(messages(OTHER, DOC), max_new_tokens=16, return_logits=True)  # DOC now sits after OTHER
    assert any(kind == "APPROXIMATE" for _, _, kind in result.stats.chunks)
    assert result.stats.reused_by_tier.get("disk", 0) > 0
    assert second.cache_stats().hits["APPROXIMATE"] > 0
    # the same approximate reuse (same plan, same repair) as from memory, bit for bit: the disk adds no error
    memory = in_memory(smollm, messages(DOC)[:1], messages(OTHER)[:1], reuse="approx")
    from_memory = memory.chat(messages(OTHER, DOC), max_new_tokens=16, return_logits=True)
    assert from_memory.stats.chunks == result.stats.chunks
    assert torch.equal(result.first_logits, from_memory.first_logits)
    assert result.token_ids == from_memory.token_ids
    # and close to a full prefill, as approximate reuse with selective repair is (test_approx_real). Measured
    # here: KL 0.019 at the first answer token, the first 13 of 16 greedy tokens the same.
    cold = smollm.with_options(reuse="off").chat(messages(OTHER, DOC), max_new_tokens=16, return_logits=True)
    assert kl(cold.first_logits, result.first_logits) < 0.05
    assert common_prefix(result.token_ids, cold.token_ids) >= 8


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
    assert second.cache_stats().disk_misses >= 1
    # the damaged chunks were computed again and written anew: a third engine reads every one of them cleanly
    third = restart(smollm, tmp_path, kv_quant="none")
    again = third.chat(messages(DOC), max_new_tokens=24)
    assert again.token_ids == cold.token_ids
    assert third.cache_stats().disk_misses == 0
    assert again.stats.reused_by_tier.get("disk", 0) >= result.stats.reused_by_tier.get("disk", 0)


def test_int8_disk_tier_gives_the_cold_answer_here(smollm, tmp_path):
    first = restart(smollm, tmp_path, kv_quant="int8")  # an opt-in: the default is lossless
    first.warm(messages(DOC)[:1])
    second = restart(smollm, tmp_path, kv_quant="int8")
    result = second.chat(messages(DOC), max_new_tokens=24)
    assert result.stats.reused_by_tier.get("disk", 0) > 0
    assert "QUANTIZED" in {kind for _, _, kind in result.stats.chunks}
    # int8 KV is not bit-exact; on this prompt the greedy answer is still the cold one (bench/kv_tiers.py
    # measures agreement and KL over more prompts)
    cold = smollm.with_options(reuse="off").chat(messages(DOC), max_new_tokens=24)
    assert result.token_ids == cold.token_ids


def test_memory_report_lists_every_tier(smollm, tmp_path):
    engine = restart(smollm, tmp_path)
    engine.warm(messages(DOC)[:1])
    report = engine.memory()
    assert set(report.kv_bytes) == {"device", "host", "disk"}
    assert report.kv_bytes["disk"] > 0 and report.kv_budget_bytes["disk"] > 0


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
