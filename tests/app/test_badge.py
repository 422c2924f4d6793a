"""The answer badge: reuse, speed, and with speculative decoding the share of drafted tokens the model kept."""

from __future__ import annotations

from app.chat_view import badge_text

STATS = {"prompt_tokens": 200, "reused_tokens": 150, "ttft_ms": 42.0, "decode_tokens_per_s": 31.5}


def test_the_badge_says_how_many_drafts_were_kept_when_there_were_drafts():
    text = badge_text({**STATS, "drafted_tokens": 40, "accepted_tokens": 30})
    assert text == "75% reused, TTFT 42 ms, 31.5 tok/s, 75% of drafts kept"


def test_without_drafts_the_badge_does_not_mention_them():
    assert "drafts" not in badge_text({**STATS, "drafted_tokens": 0, "accepted_tokens": 0})
    assert badge_text(STATS, "length") == "75% reused, TTFT 42 ms, 31.5 tok/s · hit max tokens"
