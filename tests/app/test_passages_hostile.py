"""Passage splitting and heading detection stay linear in their input, whatever the text looks like."""

from __future__ import annotations

import re
import time

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from app.passages import markdown_headings, split_passages

# A heading line of ~1 MB: the old heading regex needed hours on it (quadratic in the run of blanks).
HUGE = 1_000_000
# Generous for a shared machine; a linear pass over 1 MB is tens of milliseconds.
BOUND_S = 2.0

# The heading rule as the regex it used to be: the reference on short lines, where it was fast.
# The title group is tried last ("??"): a run of '#' right after the opening's blank is a closing sequence, so
# "# #" is an empty heading (CommonMark), as "## ##" in the rules above.
_REFERENCE_ATX = re.compile(r" {0,3}#{1,6}(?:[ \t]+(.*?))??(?:[ \t]+#+)?[ \t]*$")


def _timed(function, *args, **kwargs):
    started = time.perf_counter()
    result = function(*args, **kwargs)
    return result, time.perf_counter() - started


@pytest.mark.timeout(60)
@pytest.mark.parametrize("blank", [" ", "\t", " \t"])
def test_heading_line_with_a_megabyte_of_blanks_is_read_in_linear_time(blank):
    run = blank * (HUGE // len(blank))
    text = "# a" + run + "b\n\nbody text under it\n# closing" + run + "##" + run + "\n"

    headings, elapsed = _timed(markdown_headings, text)

    assert elapsed < BOUND_S
    assert [title for _, title in headings] == ["a" + run + "b", "closing"]


@pytest.mark.timeout(60)
def test_splitting_a_megabyte_markdown_line_of_blanks_is_linear():
    text = "# a" + " \t" * (HUGE // 2) + "b\n" + "word " * 1000 + "\n" + "\t" * HUGE + "\n\n# end\n"

    passages, elapsed = _timed(lambda: split_passages(text, passage_chars=500, sections=markdown_headings(text)))

    assert elapsed < BOUND_S
    assert all(text[p.start:p.end] == p.text and len(p.text) <= 750 for p in passages)
    assert passages[-1].text == "# end" and passages[-1].section == "end"


def test_atx_headings_follow_the_usual_rules():
    text = "\n".join([
        "# One", "##   Two  ##  ", "### Three#", "#### # Four #", "#Not", "####### Seven", "    # Indented code",
        "   # Three spaces", "#", "## ##", "#\tTabbed\t#\t", "Setext", "===", "Dashes", "---",
    ])
    assert [title for _, title in markdown_headings(text)] == [
        "One", "Two", "Three#", "# Four", "Three spaces", "Tabbed", "Setext", "Dashes",
    ]


_line = st.text(alphabet=st.sampled_from(list(" \t#abc=-`~\x0c\r")), max_size=30)


@settings(max_examples=400, deadline=None)
@given(_line)
@example("# #")  # found by a run: the reference read the closing '#' as a title
def test_heading_detection_matches_the_reference_rule_on_short_lines(line):
    expected = _REFERENCE_ATX.match(line)
    headings = markdown_headings(line)
    if expected and expected.group(1) and expected.group(1).strip():
        assert headings == [(0, expected.group(1).strip())]
    elif expected:
        assert headings == []


_text = st.text(alphabet=st.sampled_from(list("ab #\t\n.!?;: =-`~\r") + ["。", "Ü", "\x0c"]), max_size=400)


@settings(max_examples=300, deadline=None)
@given(_text, st.integers(min_value=1, max_value=60))
def test_arbitrary_text_splits_into_exact_ordered_passages_covering_it(text, passage_chars):
    sections = markdown_headings(text)
    assert all(0 <= offset <= len(text) for offset, _ in sections)

    passages = split_passages(text, passage_chars=passage_chars, sections=sections)

    previous_end = 0
    for passage in passages:
        assert text[passage.start:passage.end] == passage.text == passage.text.strip() != ""
        assert passage.start >= previous_end
        assert len(passage.text) <= 1.5 * passage_chars
        previous_end = passage.end
    covered = "".join(p.text for p in passages)
    assert "".join(covered.split()) == "".join(text.split())
