"""Splitting token ids into chunks: fixed, semantic and adaptive boundaries.

Every chunker is prefix-stable: the cuts it makes in a prompt are the cuts it makes in any extension of that
prompt, except for the last, incomplete chunk, whose cut could still move once more text arrives. Only
complete chunks get chained keys; the incomplete rest is the "tail" (see engine.kv.store).
"""

from __future__ import annotations

from typing import Callable, Sequence

from .config import ChunkingConfig

# Break strength of a token, judged from its text: cut *after* it.
NO_BREAK, LINE_BREAK, SENTENCE_BREAK, PARAGRAPH_BREAK = 0, 1, 2, 3

_SENTENCE_ENDS = (".", "!", "?", ":", ";", ".\"", ".)", "?\"", "!\"")


def classify_token_text(text: str) -> int:
    if "\n\n" in text or (text.endswith("\n") and text.strip("\n") == "" and len(text) >= 2):
        return PARAGRAPH_BREAK
    if text.endswith("\n"):
        return LINE_BREAK
    if text.rstrip().endswith(_SENTENCE_ENDS) and text.strip():
        return SENTENCE_BREAK
    return NO_BREAK


class TokenBreaks:
    """Break strength per token id for one tokenizer, computed lazily and memoised."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._memo: dict[int, int] = {}

    def __call__(self, token_id: int) -> int:
        strength = self._memo.get(token_id)
        if strength is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            strength = classify_token_text(text)
            self._memo[token_id] = strength
        return strength


Span = tuple[int, int]


def chunk_spans(ids: Sequence[int], cfg: ChunkingConfig, breaks: Callable[[int], int]) -> tuple[list[Span], int]:
    """Cuts `ids` into spans covering [0, len(ids)). Returns (spans, num_complete): spans[:num_complete]
    are final; the remaining span (at most one) is the incomplete tail."""
    n = len(ids)
    if cfg.mode == "fixed":
        spans = [(s, min(s + cfg.size, n)) for s in range(0, n, cfg.size)]
        num_complete = n // cfg.size
        return spans, num_complete
    if cfg.mode == "semantic":
        cut = _semantic_cut
    elif cfg.mode == "adaptive":
        cut = _adaptive_cut
    else:
        raise ValueError(f"unknown chunking mode {cfg.mode!r}")
    spans: list[Span] = []
    start = 0
    while start < n:
        end = cut(ids, start, cfg, breaks)
        if end is None:  # decision needs tokens past the end of the prompt
            spans.append((start, n))
            return spans, len(spans) - 1
        spans.append((start, end))
        start = end
    return spans, len(spans)


def _semantic_cut(ids, start, cfg, breaks) -> int | None:
    """Cut after the strongest break in [start + size/4, start + size), latest among equals; hard cut at
    start + size when the window holds none."""
    limit = start + cfg.size
    if limit > len(ids):
        return None
    best_pos, best_strength = limit, NO_BREAK
    for pos in range(start + cfg.size // 4, limit):
        strength = breaks(ids[pos - 1])
        if strength >= best_strength and strength > NO_BREAK:
            best_pos, best_strength = pos, strength
    return best_pos


def _adaptive_cut(ids, start, cfg, breaks) -> int | None:
    """Move the fixed cut at start + size to the nearest break within +-window (earlier wins a tie,
    sentence/paragraph ends win over line ends)."""
    target = start + cfg.size
    if target + cfg.window > len(ids):
        return None
    best: tuple[int, int, int] | None = None  # (distance, -strength class, pos)
    for pos in range(target - cfg.window, target + cfg.window + 1):
        strength = breaks(ids[pos - 1])
        if strength == NO_BREAK:
            continue
        key = (abs(pos - target), 0 if strength >= SENTENCE_BREAK else 1, pos)
        if best is None or key < best:
            best = key
    return target if best is None else best[2]
