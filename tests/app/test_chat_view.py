"""The chat view's answers: Markdown with highlighted code blocks (each with its language and a Copy link), tables,
links that open only on the web; a model's raw HTML shown as text; "Jump to latest" while the user reads above."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QUrl
from PySide6.QtGui import QGuiApplication

from app.chat_view import ChatView, MessageWidget
from app.markdown_view import render

ANSWER = """Use this:

```python
def add(a, b):
    return a + b
```

| name | value |
|---|---|
| x | 1 |

Then run `add(1, 2)`, see [the docs](https://docs.python.org) or [this](javascript:alert(1)).
<img src="http://127.0.0.1:9/track.png"> <b>not bold</b>

```
plain text block
```
"""


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_code_blocks_are_highlighted_and_labelled_and_nothing_of_the_models_html_is_rendered(theme):
    page, blocks = render(ANSWER, theme)
    assert blocks == ["def add(a, b):\n    return a + b\n", "plain text block\n"]
    assert ">python</td>" in page and ">code</td>" in page  # the language bar; "code" where none is given
    assert 'href="copy:0"' in page and 'href="copy:1"' in page
    assert '<span style="color' in page.split("copy:1")[0]  # Pygments' colours on the python block
    assert "<th>name</th>" in page and "<code>add(1, 2)</code>" in page
    assert '<a href="https://docs.python.org">the docs</a>' in page
    assert 'href="javascript' not in page and "[this](javascript:alert(1))" in page  # shown, not a link
    assert "<img" not in page and "&lt;img" in page and "<b>" not in page


def test_a_fence_still_open_while_streaming_is_already_a_code_block():
    page, blocks = render("Here it comes:\n\n```js\nconst x = 1;\nconst y", "light")
    assert blocks == ["const x = 1;\nconst y"] and ">js</td>" in page


def test_copy_copies_the_block_and_only_web_links_leave_the_app(qtbot, monkeypatch):
    opened = []
    monkeypatch.setattr("app.chat_view.QDesktopServices.openUrl", lambda url: opened.append(url.toString()))
    widget = MessageWidget({"id": 1, "role": "assistant", "content": ANSWER}, "light")
    qtbot.addWidget(widget)
    assert "def add" in widget.body.toPlainText() and "```" not in widget.body.toPlainText()
    QGuiApplication.clipboard().setText("")
    widget.body.anchorClicked.emit(QUrl("copy:0"))
    assert QGuiApplication.clipboard().text() == "def add(a, b):\n    return a + b\n"
    for bad in ("copy:7", "copy:-1", "copy:x", "file:///etc/passwd", "javascript:alert(1)"):
        widget.body.anchorClicked.emit(QUrl(bad))
    assert QGuiApplication.clipboard().text() == "def add(a, b):\n    return a + b\n" and opened == []
    widget.body.anchorClicked.emit(QUrl("https://docs.python.org"))
    assert opened == ["https://docs.python.org"]


def test_reading_above_offers_jump_to_latest_and_it_follows_the_answer_again(qtbot):
    view = ChatView("light")
    qtbot.addWidget(view)
    view.resize(600, 300)
    view.show()
    for i in range(12):
        view.add_message({"id": i, "role": "user" if i % 2 == 0 else "assistant", "content": f"message {i}\n" * 6})
    qtbot.waitUntil(lambda: view.verticalScrollBar().maximum() > 0)
    bar = view.verticalScrollBar()
    qtbot.waitUntil(lambda: bar.value() == bar.maximum())  # follows the end
    assert not view.jump_button.isVisible()
    bar.setValue(0)  # the user scrolls up to read
    view.widgets[-1].append_text("more of the answer\n" * 20)
    qtbot.waitUntil(lambda: view.jump_button.isVisible())
    assert bar.value() == 0  # not pulled down while reading
    view.jump_button.click()
    assert bar.value() == bar.maximum() and not view.jump_button.isVisible()
    view.widgets[-1].append_text("and the end\n" * 20)
    qtbot.waitUntil(lambda: bar.maximum() > 0 and bar.value() == bar.maximum())  # following again


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_a_long_stats_line_is_cut_short_and_the_buttons_stay_inside_a_narrow_view(qtbot, theme):
    """At the chat width a 1024 px window leaves (~700 px), an answer's stats line gives way ("…", the whole line
    in its tooltip) instead of pushing Copy and Regenerate out of the view."""
    view = ChatView(theme)
    qtbot.addWidget(view)
    view.resize(700, 400)
    view.show()
    stats = {"prompt_tokens": 176, "reused_tokens": 160, "ttft_ms": 78.0, "decode_tokens_per_s": 65.2,
             "generated_tokens": 36, "recomputed_tokens": 16, "reuse": "chunk"}
    widget = view.add_message({"id": 1, "role": "assistant", "content": ANSWER, "stats": stats})
    widget.set_answer({"stats": stats, "segments": [{"kind": "EXACT", "start": 0, "end": 160}],
                       "finish_reason": "length"})
    qtbot.waitUntil(lambda: widget.regenerate_button.isVisible())
    right = view.viewport().width()
    for button in (widget.map_button, widget.copy_button, widget.regenerate_button):
        assert button.mapTo(view.viewport(), button.rect().bottomRight()).x() <= right, button.text()
    assert widget.badge.is_elided() and widget.badge.text() in widget.badge.toolTip()


def test_a_long_streaming_answer_is_rendered_less_often_and_shown_whole_at_last(qtbot):
    """A render of the whole Markdown (and the save before it) grows with the answer; the engine decodes on the same
    cores, so a long answer's renders come further apart than RENDER_INTERVAL_MS, in proportion to what one took,
    and what streams in after still reaches the screen."""
    from app.chat_view import RENDER_INTERVAL_MS

    widget = MessageWidget({"id": 1, "role": "assistant", "content": ""}, "light")
    qtbot.addWidget(widget)
    saved = []
    widget.rendered.connect(saved.append)
    widget.append_text("A short start.")
    qtbot.waitUntil(lambda: widget.shown_text == "A short start.", timeout=5000)
    paragraph = "The keeper **climbed** the stairs, counted the ships and wrote `lamp lit` in the log.\n\n"
    long_text = "A short start." + paragraph * 4000  # ~340k characters: a render takes tens of milliseconds
    widget.append_text(long_text[len("A short start."):])
    qtbot.waitUntil(lambda: widget.shown_text == long_text, timeout=20000)
    assert widget._render_timer.interval() > RENDER_INTERVAL_MS
    widget.append_text("The end.")  # comes later than RENDER_INTERVAL_MS now, but comes
    qtbot.waitUntil(lambda: widget.shown_text == long_text + "The end.", timeout=20000)
    assert saved[-1] == long_text + "The end."  # saved before it was shown, as every render is
