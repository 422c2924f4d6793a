"""The answer's stats line: speed, first token, how much came from the cache, in a user's words; the engine's words
(reuse mode, drafts, tiers) in its tooltip."""

from __future__ import annotations

from app.chat_view import badge_details, badge_text

STATS = {"prompt_tokens": 200, "reused_tokens": 150, "recomputed_tokens": 50, "ttft_ms": 42.0,
         "decode_tokens_per_s": 31.5, "generated_tokens": 20, "reuse": "chunk"}


def test_the_line_says_speed_first_token_and_cache_share_in_plain_words():
    assert badge_text(STATS) == "31.5 tok/s · first token in 42 ms · 75% from cache"
    assert badge_text(STATS, "length") == "31.5 tok/s · first token in 42 ms · 75% from cache · hit max tokens"
    assert badge_text(STATS, "cancelled").endswith("· stopped")


def test_engine_words_stay_out_of_the_line_and_go_to_the_tooltip():
    stats = {**STATS, "drafted_tokens": 40, "accepted_tokens": 30, "reused_by_tier": {"device": 100, "disk": 50}}
    line = badge_text(stats)
    for jargon in ("draft", "TTFT", "EXACT", "chunk", "reuse"):
        assert jargon not in line
    details = badge_details(stats)
    assert "40 tokens drafted, 75% kept" in details and "reuse mode chunk" in details
    assert "device 100, disk 50" in details and "150 reused from the KV cache" in details


def test_a_remote_answer_names_its_server_and_its_cache_share_only_where_it_reports_one():
    remote = {"remote": True, "model": "m", "prompt_tokens": 10, "reused_tokens": 5, "ttft_ms": 9.0}
    assert badge_text(remote) == "remote m · first token in 9 ms"
    reported = {**remote, "kvboost": {"reused_tokens": 5}}
    assert badge_text(reported) == "remote m · first token in 9 ms · 50% from cache there"
