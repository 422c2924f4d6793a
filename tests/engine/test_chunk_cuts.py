"""Where the semantic and adaptive chunkers cut, exactly: the rules their docstrings state (semantic: the strongest
break in [start + size/4, start + size), the latest among equals; adaptive: the nearest break within the window,
a sentence end over a line end at the same distance, the earlier among equals). Cuts are part of every chunk key,
so a rule that moved would silently make every stored chunk unreachable."""

from __future__ import annotations

from engine.chunking import LINE_BREAK, NO_BREAK, PARAGRAPH_BREAK, SENTENCE_BREAK, chunk_spans
from engine.config import ChunkingConfig

PERIOD, NEWLINE, NEWLINES, WORD = 7, 8, 9, 30


def breaks(token_id: int) -> int:
    return {PERIOD: SENTENCE_BREAK, NEWLINE: LINE_BREAK, NEWLINES: PARAGRAPH_BREAK}.get(token_id, NO_BREAK)


def prompt_with(n: int, marks: dict[int, int]) -> list[int]:
    """`n` words with the tokens `marks` ({position: token}) in place."""
    return [marks.get(i, WORD) for i in range(n)]


def first_cut(ids, cfg) -> int:
    spans, num_complete = chunk_spans(ids, cfg, breaks)
    assert num_complete >= 1
    return spans[0][1]


def test_semantic_cuts_after_the_latest_of_equal_breaks():
    cfg = ChunkingConfig(mode="semantic", size=32)
    ids = prompt_with(80, {12: PERIOD, 20: PERIOD, 25: NEWLINE})
    assert first_cut(ids, cfg) == 21  # after the second sentence end; the later line end is weaker


def test_semantic_never_cuts_before_a_quarter_of_the_size():
    cfg = ChunkingConfig(mode="semantic", size=32)
    ids = prompt_with(80, {3: NEWLINES, 6: NEWLINES, 20: NEWLINE})
    assert first_cut(ids, cfg) == 21  # the paragraph ends at 4 and 7 lie before 32 // 4 = 8
    assert first_cut(prompt_with(80, {}), cfg) == 32  # no break: the hard cut


def test_adaptive_prefers_a_sentence_end_over_a_line_end_at_the_same_distance():
    cfg = ChunkingConfig(mode="adaptive", size=32, window=4)
    ids = prompt_with(80, {29: NEWLINE, 33: PERIOD})  # cuts at 30 and 34: both 2 from the target 32
    assert first_cut(ids, cfg) == 34
    ids = prompt_with(80, {29: PERIOD, 33: PERIOD})  # equals: the earlier
    assert first_cut(ids, cfg) == 30
    ids = prompt_with(80, {30: NEWLINE, 33: PERIOD})  # the line end is nearer: distance wins over strength
    assert first_cut(ids, cfg) == 31
