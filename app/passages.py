"""Cutting a document's text into passages for retrieval, and finding its Markdown headings.

Offsets are exact: for every passage, `text[p.start:p.end] == p.text`. Whitespace around a passage is trimmed
by moving its offsets, never by editing the text.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from itertools import pairwise


@dataclass(frozen=True)
class Passage:
    text: str
    start: int  # offset of the passage in ExtractedDocument.text
    end: int
    page: int | None  # 1-based PDF page, None for other kinds
    section: str | None  # nearest Markdown / DOCX heading at or before `start`



_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})")
_SETEXT_UNDERLINE = re.compile(r" {0,3}(?:=+|-+)[ \t]*$")
_FRONT_MATTER = re.compile(r"---\n.*?^(?:---|\.\.\.)[ \t]*$", re.DOTALL | re.MULTILINE)
_BLOCK_START = re.compile(r" {0,3}(?:[-+*>|]|\d+[.)])(?:\s|$)")


def markdown_headings(text: str) -> list[tuple[int, str]]:
    """[(offset of the heading line, heading text)] for '#' and underlined headings outside code fences
    and YAML front matter."""
    headings: list[tuple[int, str]] = []
    fence: str | None = None
    front_matter = _FRONT_MATTER.match(text)
    front_matter_end = front_matter.end() if front_matter else 0
    previous: tuple[int, str] | None = None  # the line before, when it could be an underlined heading's text
    offset = 0
    for line in text.split("\n"):
        line_start, offset = offset, offset + len(line) + 1
        candidate, previous = previous, None
        if line_start < front_matter_end:
            continue
        fence_match = _FENCE.match(line)
        if fence is not None:
            closing = fence_match and fence_match.group(1)[0] == fence[0] and len(fence_match.group(1)) >= len(fence)
            if closing and line.strip() == fence_match.group(1):
                fence = None
            continue
        if fence_match:
            fence = fence_match.group(1)
            continue
        heading = _atx_heading(line)
        if heading is not None:
            if heading:
                headings.append((line_start, heading))
            continue
        if candidate is not None and _SETEXT_UNDERLINE.match(line):
            headings.append(candidate)
            continue
        if line.strip() and not _BLOCK_START.match(line) and not line.startswith(("    ", "\t")):
            previous = (line_start, line.strip())
    return headings


def _atx_heading(line: str) -> str | None:
    """The text of a '#' heading line ("" for an empty one), None when the line is not one.

    Parsed by hand, not by regex: any regex that finds the optional closing '#'s after a lazy title retries the
    run of blanks before them from every position, which is quadratic in the line (hours on a 1 MB line).
    """
    indent = len(line) - len(line.lstrip(" "))
    if indent > 3:
        return None
    level = len(line) - indent - len(line[indent:].lstrip("#"))
    if not 1 <= level <= 6:
        return None
    rest = line[indent + level:]
    if rest and rest[0] not in " \t":
        return None
    title = rest.strip(" \t")
    without_closing = title.rstrip("#")
    if not without_closing or without_closing[-1] in " \t":  # a closing run of '#' follows a blank
        title = without_closing
    return title.strip()


# Separators tried in turn on a stretch too long for one passage: blank lines, line breaks, sentence ends.
# What is still too long is cut at the last space that fits, and a single word longer than a passage is cut
# at the size limit.
_SEPARATORS = (
    re.compile(r"\n[ \t]*\n\s*"),
    re.compile(r"\n\s*"),
    re.compile(r"(?<=[.!?;:])\s+|(?<=[。！？])\s*"),
)
_WORD_GAP = re.compile(r"\s+")
# A last passage shorter than this fraction of passage_chars joins the one before, up to 1.5x its size.
_SMALL_TAIL_FRACTION = 0.25
_MAX_GROWTH = 1.5


def split_passages(
    text: str,
    *,
    passage_chars: int = 1000,
    pages: list[tuple[int, int]] | None = None,
    sections: list[tuple[int, str]] | None = None,
) -> list[Passage]:
    """Split text into passages of about passage_chars (at most 1.5x), at the coarsest boundary that fits.

    `pages` and `sections` are [(start_offset, label)]. A passage never spans a page start or a section
    start, so its page and section (the last ones starting at or before it) describe all of it.
    """
    if passage_chars < 1:
        raise ValueError(f"passage_chars must be at least 1, got {passage_chars}")
    pages = sorted(pages or [])
    sections = sorted(sections or [], key=lambda section: section[0])
    page_offsets = [offset for offset, _ in pages]
    section_offsets = [offset for offset, _ in sections]
    cuts = sorted({0, len(text)} | {min(max(o, 0), len(text)) for o in page_offsets + section_offsets})

    passages = []
    for region_start, region_end in pairwise(cuts):
        for start, end in _pack(_pieces(text, region_start, region_end, passage_chars), passage_chars):
            passages.append(Passage(
                text=text[start:end],
                start=start,
                end=end,
                page=_label_at(pages, page_offsets, start),
                section=_label_at(sections, section_offsets, start),
            ))
    return passages


def _pieces(text: str, start: int, end: int, limit: int, level: int = 0) -> list[tuple[int, int]]:
    """Whitespace-trimmed spans of text[start:end], each at most `limit` long, in order."""
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    if start == end:
        return []
    if end - start <= limit:
        return [(start, end)]
    if level == len(_SEPARATORS):
        return _cut_between_words(text, start, end, limit)
    spans, position = [], start
    for separator in _SEPARATORS[level].finditer(text, start, end):
        spans += _pieces(text, position, separator.start(), limit, level + 1)
        position = separator.end()
    spans += _pieces(text, position, end, limit, level + 1)
    return spans


def _cut_between_words(text: str, start: int, end: int, limit: int) -> list[tuple[int, int]]:
    """Greedy spans of at most `limit`, each ending before a gap between words; text[start:end] is trimmed."""
    spans = []
    while end - start > limit:
        # Looking one window ahead at a time keeps a huge unbroken paragraph linear in its length.
        last_gap = None
        for gap in _WORD_GAP.finditer(text, start + 1, start + limit + 1):
            last_gap = gap
        if last_gap is None:  # one word longer than a passage
            spans.append((start, start + limit))
            start += limit
        else:
            spans.append((start, last_gap.start()))
            start = last_gap.end()
        while text[start].isspace():  # a gap can run on past the window
            start += 1
    spans.append((start, end))
    return spans


def _pack(pieces: list[tuple[int, int]], limit: int) -> list[tuple[int, int]]:
    """Join consecutive pieces (with the text between them) while the result stays within `limit`."""
    spans: list[tuple[int, int]] = []
    for start, end in pieces:
        if spans and end - spans[-1][0] <= limit:
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((start, end))
    if len(spans) >= 2:
        (before_start, _), (tail_start, tail_end) = spans[-2], spans[-1]
        if tail_end - tail_start < limit * _SMALL_TAIL_FRACTION and tail_end - before_start <= limit * _MAX_GROWTH:
            spans[-2:] = [(before_start, tail_end)]
    return spans


def _label_at(labels: list[tuple[int, object]], offsets: list[int], position: int) -> object | None:
    index = bisect.bisect_right(offsets, position) - 1
    return labels[index][1] if index >= 0 else None
