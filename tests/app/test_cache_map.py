"""The cache map names hits on quantized KV as QUANTIZED, in their own colour, apart from EXACT ones."""

from __future__ import annotations

from app.chat_view import cache_map_html
from app.theme import KIND_COLORS


def test_quantized_segments_are_shown_and_counted_as_their_own_kind():
    answer = {"stats": {"prompt_tokens": 30, "reused_tokens": 20, "ttft_ms": 10, "reuse": "chunk",
                        "reused_by_tier": {"disk": 20}},
              "segments": [{"start": 0, "end": 12, "kind": "EXACT", "text": "alpha "},
                           {"start": 12, "end": 20, "kind": "QUANTIZED", "text": "beta "},
                           {"start": 20, "end": 30, "kind": "MISS", "text": "gamma"}]}
    for theme in ("light", "dark"):
        html = cache_map_html(answer, theme)
        assert "QUANTIZED 8" in html and "EXACT 12" in html and "MISS 10" in html
        quantized = KIND_COLORS[theme]["QUANTIZED"]
        assert quantized != KIND_COLORS[theme]["EXACT"]
        assert f'background:{quantized}" title="QUANTIZED tokens 12-20"' in html


def test_chunks_from_the_shared_kv_store_are_counted_in_the_summary():
    answer = {"stats": {"prompt_tokens": 40, "reused_tokens": 32, "ttft_ms": 10, "reuse": "chunk",
                        "reused_by_tier": {"remote": 24, "disk": 8}},
              "segments": [{"start": 0, "end": 32, "kind": "EXACT", "text": "alpha "},
                           {"start": 32, "end": 40, "kind": "MISS", "text": "gamma"}]}
    html = cache_map_html(answer, "light")
    assert "8 from the disk cache, 24 from the shared cache" in html
