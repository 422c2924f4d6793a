"""What the docs promise of the desktop app (docs/guide/app.md, docs/promises.md), each checked through real
widgets, real key and mouse events, real SQLite files and real processes. Expected values are stated or computed
here, not taken from the app."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from PySide6.QtCore import QObject, Qt, QTimer, QUrl, Slot
from PySide6.QtGui import QDesktopServices, QFont
from PySide6.QtWidgets import QApplication, QInputDialog, QLineEdit, QPushButton
from qt_helpers import WAIT_MS, result_of

from app import rag

GREEDY_SHORT = {"temperature": 0.0, "max_new_tokens": 4}


@pytest.fixture
def idle_window(qtbot, db, client, aio_loop):
    """The main window over an engine client with no model loaded (what these checks need is the UI)."""
    from app.main_window import MainWindow

    window = MainWindow(db, client, theme_choice="light")
    qtbot.addWidget(window)
    window.show()
    qtbot.waitExposed(window)
    return window


def answer_next_input_dialog(text: str, offered: list) -> None:
    """Types `text` into the next modal QInputDialog (key events into its line edit, then Enter) and records
    the text it offered; gives up after ~5 s so a dialog that never opens fails the test, not the session."""
    tries = [0]

    def fill():
        dialog = QApplication.activeModalWidget()
        if not isinstance(dialog, QInputDialog):
            tries[0] += 1
            if tries[0] < 250:
                QTimer.singleShot(20, fill)
            return
        edit = dialog.findChild(QLineEdit)
        offered.append(edit.text())
        edit.selectAll()
        from PySide6.QtTest import QTest

        QTest.keyClicks(edit, text)
        QTest.keyClick(edit, Qt.Key_Return)

    QTimer.singleShot(0, fill)


# -- tabs: F2 and double-click rename ----------------------------------------------------------------------
def test_f2_renames_the_current_tab(qtbot, idle_window):
    window = idle_window
    tab = window.current_tab()
    old = window.tabs.tabText(0)
    offered = []
    answer_next_input_dialog("Packing list", offered)
    qtbot.keyClick(window, Qt.Key_F2)

    assert offered == [old]
    assert window.tabs.tabText(0) == "Packing list"
    assert window.db.conversation(tab.conversation_id)["title"] == "Packing list"


def test_double_clicking_a_tab_renames_that_tab(qtbot, idle_window):
    window = idle_window
    window.new_conversation()
    window.tabs.setCurrentIndex(1)
    first = window.tabs.widget(0)
    old = window.tabs.tabText(0)
    bar = window.tabs.tabBar()
    offered = []
    answer_next_input_dialog("Trip plans", offered)
    qtbot.mouseDClick(bar, Qt.LeftButton, Qt.NoModifier, bar.tabRect(0).center())

    assert offered == [old]
    assert window.tabs.tabText(0) == "Trip plans"
    assert window.tabs.tabText(1) != "Trip plans"
    assert window.db.conversation(first.conversation_id)["title"] == "Trip plans"


# -- chat: Shift+Enter is a new line, Enter sends -----------------------------------------------------------
def test_shift_enter_is_a_new_line_and_enter_sends(qtbot, window):
    tab = window.current_tab()
    window.db.update_conversation(tab.conversation_id, sampling=GREEDY_SHORT)
    tab.composer.setFocus()
    qtbot.keyClicks(tab.composer, "first line")
    qtbot.keyClick(tab.composer, Qt.Key_Return, Qt.ShiftModifier)
    qtbot.keyClicks(tab.composer, "second line")

    assert tab.composer.toPlainText() == "first line\nsecond line"
    assert window.db.messages(tab.conversation_id) == []

    qtbot.keyClick(tab.composer, Qt.Key_Return)
    result_of(qtbot, tab.request)
    messages = window.db.messages(tab.conversation_id)
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[0]["content"] == "first line\nsecond line"
    assert tab.composer.toPlainText() == ""


# -- chat: Markdown with code blocks ------------------------------------------------------------------------
MARKDOWN_ANSWER = "Use **bold words** here.\n\n```python\nprint('harbour')\n```\n\nDone."


def test_answers_render_markdown_bold_and_code_blocks(qtbot, db, client):
    from app.conversation_tab import ConversationTab

    conversation = db.create_conversation()
    db.add_message(conversation["id"], "user", "Show me code")
    db.add_message(conversation["id"], "assistant", MARKDOWN_ANSWER)
    tab = ConversationTab(db.conversation(conversation["id"]), db, client, "light")
    qtbot.addWidget(tab)
    document = tab.chat_view.widgets[-1].body.document()

    plain = document.toPlainText()
    assert "**" not in plain and "```" not in plain
    blocks = []
    block = document.begin()
    while block.isValid():
        blocks.append(block)
        block = block.next()
    code = [b for b in blocks if b.text() == "print('harbour')"]
    assert len(code) == 1, [b.text() for b in blocks]
    code_format = code[0].blockFormat()  # a fenced code block: lines never wrapped, under its language and Copy
    assert code_format.nonBreakableLines()
    assert "<pre" in document.toHtml() and 'href="copy:0"' in document.toHtml()
    assert "python" in [b.text() for b in blocks] and "Copy" in plain
    bold = []
    for b in blocks:
        it = b.begin()
        while not it.atEnd():
            fragment = it.fragment()
            if fragment.charFormat().fontWeight() >= QFont.Weight.Bold:
                bold.append(fragment.text())
            it += 1
    assert "bold words" in bold
    assert not any("Use" in t or "here" in t for t in bold)


# -- sources: a click opens the file ------------------------------------------------------------------------
class _UrlCatcher(QObject):
    def __init__(self):
        super().__init__()
        self.urls: list[QUrl] = []

    @Slot(QUrl)
    def open_url(self, url: QUrl) -> None:
        self.urls.append(url)


def test_clicking_a_source_opens_its_file(qtbot, db, client, tmp_path):
    from app.conversation_tab import ConversationTab

    path = tmp_path / "notes folder" / "gull island.md"
    path.parent.mkdir()
    path.write_text("# Gull Island\n\nThe keeper is Margarethe Olsen.\n", encoding="utf-8")
    conversation = db.create_conversation()
    db.add_message(conversation["id"], "user", "Who keeps the light?")
    db.add_message(conversation["id"], "assistant", "Margarethe Olsen.", sources=[
        {"id": 1, "document_id": 1, "name": "gull island.md", "path": str(path), "page": None, "section": None,
         "text": "The keeper is Margarethe Olsen."}])
    tab = ConversationTab(db.conversation(conversation["id"]), db, client, "light")
    qtbot.addWidget(tab)
    tab.show()
    buttons = [b for b in tab.findChildren(QPushButton) if b.objectName() == "sourceButton"]
    assert [b.text() for b in buttons] == ["gull island.md"]
    assert "Margarethe Olsen" in buttons[0].toolTip()

    catcher = _UrlCatcher()
    QDesktopServices.setUrlHandler("file", catcher, "open_url")
    try:
        qtbot.mouseClick(buttons[0], Qt.LeftButton)
    finally:
        QDesktopServices.unsetUrlHandler("file")
    assert len(catcher.urls) == 1
    assert catcher.urls[0].scheme() == "file"
    assert Path(catcher.urls[0].toLocalFile()) == path


# -- the time-saved estimate --------------------------------------------------------------------------------
def test_the_time_saved_for_the_same_reuse_stays_within_30_percent_across_a_session(qtbot, loaded_client):
    """The same reused document is worth about the same time later in the session, after short prompts (whose
    TTFT is mostly fixed costs) were answered in between."""
    client = loaded_client
    facts = " ".join(f"Fact {i}: the lighthouse keeper number {i} logs the tide at {i % 12 + 1} o'clock sharp."
                     for i in range(24))
    document = [{"role": "system", "content": facts}]
    question = document + [{"role": "user", "content": "Who logs the tide at 5 o'clock?"}]
    result_of(qtbot, client.warm([document]))

    def saved_per_reused_token(messages) -> float:
        answer = result_of(qtbot, client.chat(messages, GREEDY_SHORT))
        return answer.saved_ms / answer.stats["reused_tokens"]

    first = saved_per_reused_token(question)
    for i in range(6):  # short prompts, computed in full: each one's forward is a few dozen tokens
        words = " ".join(f"pebble{i}x{j}" for j in range(14))
        answer = result_of(qtbot, client.chat([{"role": "user", "content": f"Sort these words: {words}"}],
                                              GREEDY_SHORT))
        stats = answer.stats  # computed but for the chat template's default system lines
        assert stats["recomputed_tokens"] >= 32 and stats["reused_tokens"] < stats["recomputed_tokens"]
    later = saved_per_reused_token(question)
    assert 0.7 <= later / first <= 1.3, (first, later)


def test_time_saved_is_reused_tokens_times_the_measured_prefill_cost(qtbot, loaded_client):
    from app.chat_view import MessageWidget

    client = loaded_client
    system = " ".join(f"Fact {i}: bell number {i} of the harbour rings at {i % 12 + 1} o'clock." for i in range(8))
    messages = [{"role": "system", "content": system}]
    warm = result_of(qtbot, client.warm([messages]))
    # A fresh store: every token was computed, which is what measures the prefill cost per token (the engine's
    # timing of the forward passes, less than the whole call).
    assert warm.computed_tokens == warm.tokens >= 64
    assert 0 < warm.prefill_ms < warm.ms
    ms_per_token = warm.prefill_ms / warm.computed_tokens

    answer = result_of(qtbot, client.chat(messages + [{"role": "user", "content": "When does bell 7 ring?"}],
                                          GREEDY_SHORT))
    stats = answer.stats
    # Mostly reused: the few computed tokens (fewer than MIN_CALIBRATION_TOKENS) do not re-measure the rate.
    assert stats["reused_tokens"] > stats["prompt_tokens"] / 2
    expected = stats["reused_tokens"] * ms_per_token
    assert answer.saved_ms == pytest.approx(expected, rel=1e-9)

    widget = MessageWidget({"id": 1, "role": "assistant", "content": answer.text}, "light")
    qtbot.addWidget(widget)
    widget.set_answer(answer.to_dict())
    widget.map_button.click()
    assert f"≈{expected:.0f} ms saved" in widget.cache_map.toPlainText()


# -- documents: a touched file with the same SHA-256 is not re-read -----------------------------------------
def test_a_touched_file_with_the_same_sha256_is_not_read_again(qtbot, db, client, aio_loop, tmp_path):
    from app.conversation_tab import ConversationTab
    from app.document_worker import ExtractionLimits

    path = tmp_path / "harbour.md"
    path.write_text("# Harbour\n\nBoats moor at the north pier.\n\nMooring costs forty crowns a night.\n",
                    encoding="utf-8")
    tab = ConversationTab(db.create_conversation(), db, client, "light")
    qtbot.addWidget(tab)
    first = aio_loop.run_until_complete(tab.add_paths([str(path)]))
    assert first == {"added": 1, "unchanged": 0, "problems": []}
    before = db.find_document(str(path))
    passages_before = db.passages(before["id"])

    # Touched: new mtime, same bytes. Reading it again would now be refused (a 1-byte limit), so the drop only
    # succeeds if the file is recognised by its hash and not read.
    stat = path.stat()
    os.utime(path, (stat.st_atime + 3600, stat.st_mtime + 3600))
    tab.extraction_limits = ExtractionLimits(max_bytes=1)
    second = aio_loop.run_until_complete(tab.add_paths([str(path)]))
    assert second == {"added": 0, "unchanged": 1, "problems": []}
    after = db.find_document(str(path))
    assert after["mtime"] == pytest.approx(stat.st_mtime + 3600)
    assert db.passages(after["id"]) == passages_before

    # Same size, different bytes: read again.
    tab.extraction_limits = ExtractionLimits()
    path.write_text(path.read_text(encoding="utf-8").replace("forty", "fifty"), encoding="utf-8")
    os.utime(path, (stat.st_atime + 7200, stat.st_mtime + 7200))
    third = aio_loop.run_until_complete(tab.add_paths([str(path)]))
    assert third == {"added": 1, "unchanged": 0, "problems": []}
    assert any("fifty crowns" in p["text"] for p in db.passages(after["id"]))


# -- model: the loading stage in the status bar -------------------------------------------------------------
def test_the_loading_stage_and_elapsed_time_show_in_the_status_bar(qtbot, idle_window, tmp_path):
    window = idle_window
    shown = []
    window.client.load_stage_changed.connect(
        lambda stage: shown.append((stage, window.model_label.text(), window.load_bar.isVisible())))
    with qtbot.waitSignal(window.client.model_load_failed, timeout=WAIT_MS):
        window.load_model(str(tmp_path / "missing-model"))

    stages = [stage for stage, _, _ in shown]
    assert stages == ["Starting PyTorch and transformers…", "Reading and preparing the weights…"]
    for stage, label, bar_visible in shown:
        assert re.fullmatch(rf"Loading missing-model: {re.escape(stage)} \(\d+ s\)", label), label
        assert bar_visible
    assert window.model_label.text() == "No model loaded" and not window.load_bar.isVisible()


# -- the retrieved layout sends the top 4 passages ----------------------------------------------------------
def test_the_retrieved_layout_sends_the_top_four_passages(db, tmp_path):
    conversation = db.create_conversation()
    texts = [f"The walrus number {i} sleeps on rock {i} near the harbour." for i in range(9)]
    passages, pos = [], 0
    for text in texts:
        passages.append({"text": text, "page": None, "section": None, "start": pos, "end": pos + len(text)})
        pos += len(text) + 2
    doc = db.upsert_document(str(tmp_path / "walrus.txt"), "walrus.txt", "text", "0" * 64, 1.0, pos, pos, passages)
    db.attach_document(conversation["id"], doc["id"])

    layout = rag.prompt_for(db, conversation["id"], "Where does the walrus sleep?", max_context=64)

    assert layout.mode == "retrieved"
    assert len(layout.sources) == 4
    assert sum(text in layout.user_prompt for text in texts) == 4
    assert layout.user_prompt.count("[walrus.txt]") == 4


# -- `kvboost warm FILE` fills the disk cache ---------------------------------------------------------------
def _kvboost() -> list[str]:
    script = Path(sys.executable).with_name("kvboost")
    return [str(script)] if script.exists() else [sys.executable, "-c", "import sys; from cli.kvboost import main; "
                                                                          "sys.exit(main())"]


@pytest.mark.slow
def test_kvboost_warm_prefills_a_file_into_the_disk_cache(tmp_path):
    notes = tmp_path / "notes.md"
    notes.write_text("# Ferry times\n\n" + "\n".join(
        f"- Ferry {i} leaves the harbour at {6 + i % 12}:{(i * 7) % 60:02d}." for i in range(40)), encoding="utf-8")
    cache = tmp_path / "kv"
    env = dict(os.environ, KVBOOST_CACHE_DIR=str(cache))

    def stats() -> dict:
        out = subprocess.run(_kvboost() + ["cache", "stats", "--json"], env=env, capture_output=True, text=True,
                             timeout=120, check=True).stdout
        return json.loads(out) if out.lstrip().startswith("{") else {"entries": 0, "tokens": 0}

    assert stats()["entries"] == 0
    warmed = subprocess.run(_kvboost() + ["warm", str(notes)], env=env, capture_output=True, text=True,
                            timeout=600)
    assert warmed.returncode == 0, warmed.stderr[-2000:]
    match = re.search(r"notes\.md: (\d+) tokens, (\d+) entries stored", warmed.stdout)
    assert match, warmed.stdout
    tokens = int(match.group(1))
    after = stats()
    assert after["folder"] == str(cache)
    assert after["entries"] >= 1
    assert 0 < after["tokens"] <= tokens
    assert len(after["namespaces"]) == 1


def test_a_gguf_load_fills_the_bar_layer_by_layer_and_says_what_auto_chose(qtbot, idle_window, tmp_path):
    from gguf_files import tiny_gguf

    window = idle_window
    path = tiny_gguf(tmp_path / "tiny.gguf", "Q4_K")
    seen = []
    window.client.load_progressed.connect(
        lambda done, total, what: seen.append((done, total, window.load_bar.value(), window.load_bar.maximum(),
                                               window.model_label.text())))
    with qtbot.waitSignal(window.client.model_loaded, timeout=WAIT_MS):
        window.load_model(str(path))
    assert [(d, t) for d, t, *_ in seen] == [(0, 0), (1, 3), (2, 3), (3, 3)]  # tokenizer, two layers, head
    for done, total, value, maximum, label in seen[1:]:
        assert (value, maximum) == (done, total) and "Loading tiny.gguf: Reading the weights: " in label
    assert "layer 2 of 2" in seen[2][4]
    assert not window.load_bar.isVisible()
    assert "auto: the file's decoder weights are 4-bit codes" in window.model_label.toolTip()
    from engine.weights.gguf_blocks import expected_unavailable

    form = "blocks" if expected_unavailable() is None else "int4"  # the file's blocks where the block kernel runs
    assert f"Q4_K->{form} x14" in window.model_label.toolTip()
