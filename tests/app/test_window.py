"""The main window over the real model: sending, streaming (a long prompt's reading too), stop, tabs, search,
export/import, errors."""

from __future__ import annotations

import json
import time

import pytest
import torch
from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QCheckBox, QLabel
from qt_helpers import WAIT_MS, result_of, send

GREEDY = {"temperature": 0.0, "max_new_tokens": 24}


def greedy(window, tab, **changes):
    window.db.update_conversation(tab.conversation_id, sampling=dict(GREEDY, **changes))


def test_window_is_usable_before_a_model_is_loaded(qtbot, db, client, aio_loop):
    from app.main_window import MainWindow

    old = db.create_conversation(title="Old notes")
    db.add_message(old["id"], "user", "remember the blue door")
    db.add_message(old["id"], "assistant", "I will remember the **blue door**.")
    window = MainWindow(db, client, theme_choice="light")
    qtbot.addWidget(window)
    window.show()
    tab = window.current_tab()
    assert [w.text for w in tab.chat_view.widgets] == ["remember the blue door",
                                                       "I will remember the **blue door**."]
    assert not tab.send_button.isEnabled()
    assert "loading" in tab.reason_label.text().lower()
    # Typing works; Enter does not send without a model.
    tab.composer.setPlainText("hello")
    qtbot.keyClick(tab.composer, Qt.Key_Return)
    assert len(db.messages(old["id"])) == 2


def test_send_streams_the_answer_and_saves_it(qtbot, window):
    tab = window.current_tab()
    greedy(window, tab)
    tokens = []
    answer = send(qtbot, tab, "What is the capital of France?", on_token=tokens.append)
    assert "Paris" in answer.text
    assert len(tokens) > 3  # streamed, not delivered at once
    messages = window.db.messages(tab.conversation_id)
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[1]["content"] == answer.text and messages[1]["status"] == "done"
    assert messages[1]["stats"]["prompt_tokens"] == answer.stats["prompt_tokens"] > 0
    widget = tab.chat_view.widgets[-1]
    assert widget.text == answer.text
    assert "from cache" in widget.badge.text() and "first token in" in widget.badge.text()
    assert "reused from the KV cache" in widget.badge.toolTip()  # the engine's words: on hover
    qtbot.mouseClick(widget.copy_button, Qt.LeftButton)
    assert QGuiApplication.clipboard().text() == answer.text
    assert tab.composer.toPlainText() == "" and tab.send_button.isEnabled()


def test_follow_up_reuses_the_conversation_after_switching_tabs(qtbot, window):
    first = window.current_tab()
    greedy(window, first)
    send(qtbot, first, "Name three colors of the rainbow.")
    other = window.new_conversation()
    greedy(window, other)
    send(qtbot, other, "What is two plus two?")
    window.tabs.setCurrentWidget(first)
    answer = send(qtbot, first, "And three more?")
    stats = answer.stats
    previous = window.db.messages(first.conversation_id)[1]["stats"]["prompt_tokens"]
    # Everything up to the previous answer came from cache: only the new message was computed.
    assert stats["reused_tokens"] >= previous
    assert stats["recomputed_tokens"] < stats["prompt_tokens"] - previous + 8
    kinds = {seg["kind"] for seg in answer.segments}
    assert kinds & {"EXACT", "PREFIX"} and "APPROXIMATE" not in kinds
    # The cache map shows the prompt that was sent, coloured by kind.
    widget = first.chat_view.widgets[-1]
    qtbot.mouseClick(widget.map_button, Qt.LeftButton)
    html_text = widget.cache_map.toPlainText()
    assert "And three more?" in html_text and "reused" in html_text


def test_stop_cancels_at_the_next_token_and_keeps_the_text_on_screen(qtbot, window):
    tab = window.current_tab()
    greedy(window, tab, max_new_tokens=400)
    tab.composer.setPlainText("Write a long story about a dragon who learns to cook.")
    seen, pressed = [], []

    def on_token(text):
        seen.append(time.perf_counter())
        if len(seen) == 5:  # Esc while more tokens are on their way: the UI is busy for 0.5 s, the engine is not
            time.sleep(0.5)
            qtbot.keyClick(window, Qt.Key_Escape)
            pressed.append((time.perf_counter(), tab.chat_view.widgets[-1].text))

    finished = []
    qtbot.keyClick(tab.composer, Qt.Key_Return)
    tab.request.token.connect(on_token)
    tab.request.finished.connect(lambda *_: finished.append(time.perf_counter()))
    answer = result_of(qtbot, tab.request)
    (at, shown), = pressed
    assert answer.finish_reason == "cancelled"
    # the engine ran on while the UI slept (how far depends on the machine's speed), then stopped at its next
    # token once it saw the cancel: the answer ends soon after Esc, far short of max_new_tokens
    assert answer.stats["generated_tokens"] < 400 and finished[0] - at < 1.0
    assert len([t for t in seen if t > at]) >= 1  # tokens made before the engine saw the cancel still arrive ...
    # ... but Stop means the text stops: what arrives after it is neither shown nor saved
    assert tab.chat_view.widgets[-1].text == shown != ""
    saved = window.db.messages(tab.conversation_id)[-1]
    assert saved["status"] == "cancelled" and saved["content"] == shown
    assert "stopped" in tab.chat_view.widgets[-1].badge.text()


def test_event_loop_keeps_turning_during_a_long_generation(qtbot, window, capsys):
    tab = window.current_tab()
    greedy(window, tab, max_new_tokens=160)
    ticks = []
    timer = QTimer(interval=10)
    timer.timeout.connect(lambda: ticks.append(time.perf_counter()))
    tab.composer.setPlainText("Explain how a bicycle works, step by step.")
    timer.start()
    qtbot.keyClick(tab.composer, Qt.Key_Return)
    answer = result_of(qtbot, tab.request)
    timer.stop()
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    worst_ms = max(gaps) * 1000
    with capsys.disabled():
        print(f"\n[event loop] {len(ticks)} ticks over {answer.stats['generated_tokens']} tokens, "
              f"largest stall {worst_ms:.1f} ms")
    assert answer.stats["generated_tokens"] >= 100
    assert worst_ms < 100


def test_tabs_new_close_rename_reorder_and_reopen(qtbot, window):
    db = window.db
    first = window.current_tab()
    qtbot.keyClick(window, Qt.Key_T, Qt.ControlModifier)
    assert window.tabs.count() == 2
    second = window.current_tab()
    assert second is not first
    window.rename_tab(window.tabs.indexOf(second), "Trip plans")
    assert db.conversation(second.conversation_id)["title"] == "Trip plans"
    window.tabs.tabBar().moveTab(1, 0)
    assert [c["id"] for c in db.conversations(open_only=True)] == [second.conversation_id, first.conversation_id]
    window.tabs.setCurrentWidget(second)
    qtbot.keyClick(window, Qt.Key_W, Qt.ControlModifier)
    assert window.tabs.count() == 1 and not db.conversation(second.conversation_id)["is_open"]
    items = [window.conversation_list.item(i) for i in range(window.conversation_list.count())]
    closed = next(i for i in items if i.text().startswith("Trip plans"))
    assert "(closed)" in closed.text()
    window.on_conversation_list_item_activated(closed)
    assert window.tabs.count() == 2 and window.current_tab().conversation_id == second.conversation_id
    assert db.conversation(second.conversation_id)["is_open"]


def test_search_finds_messages_in_closed_conversations(qtbot, window):
    db = window.db
    hidden = db.create_conversation(title="Gardening")
    db.add_message(hidden["id"], "user", "When should I plant tulip bulbs?")
    db.add_message(hidden["id"], "assistant", "Plant tulips in autumn.")
    db.update_conversation(hidden["id"], is_open=0)
    qtbot.keyClicks(window.search_edit, "tulip")
    texts = [window.conversation_list.item(i).text() for i in range(window.conversation_list.count())]
    assert texts and all("Gardening" in t for t in texts)
    window.on_conversation_list_item_activated(window.conversation_list.item(0))
    assert window.current_tab().conversation_id == hidden["id"]
    qtbot.keyClicks(window.search_edit, ' AND ("')  # FTS syntax in user text never breaks search
    window.search_edit.clear()
    assert window.conversation_list.count() >= 2


def test_export_and_import_round_trip(qtbot, window, tmp_path):
    db = window.db
    tab = window.current_tab()
    db.add_message(tab.conversation_id, "user", "Write `print(1)` in a code block")
    db.add_message(tab.conversation_id, "assistant", "```python\nprint(1)\n```")
    window.rename_tab(window.tabs.indexOf(tab), "Code")
    md = window.export_current("md", str(tmp_path / "code.md"))
    js = window.export_current("json", str(tmp_path / "code.json"))
    assert "```python\nprint(1)\n```" in open(md, encoding="utf-8").read()
    imported_id = window.import_conversation(js)
    assert imported_id != tab.conversation_id
    assert [(m["role"], m["content"]) for m in db.messages(imported_id)] == \
        [(m["role"], m["content"]) for m in db.messages(tab.conversation_id)]
    assert window.current_tab().conversation_id == imported_id
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "something-else"}))
    before = len(db.conversations())
    assert window.import_conversation(str(bad)) is None
    assert window.banner.isVisible() and "bad.json" in window.banner_label.text()
    assert len(db.conversations()) == before


def test_regenerate_and_edit_and_resend(qtbot, window):
    db = window.db
    tab = window.current_tab()
    greedy(window, tab)
    send(qtbot, tab, "What is the capital of France?")
    first_answer = db.messages(tab.conversation_id)[1]
    old_widget = tab.chat_view.widgets[1]
    qtbot.mouseClick(old_widget.regenerate_button, Qt.LeftButton)
    with qtbot.waitSignal(tab.request.started, timeout=WAIT_MS):
        pass
    # The old answer is gone while the new one streams.
    assert len(tab.chat_view.widgets) == 2 and tab.chat_view.widgets[1] is not old_widget
    qtbot.waitUntil(lambda: not tab.is_generating, timeout=WAIT_MS)
    messages = db.messages(tab.conversation_id)
    assert len(messages) == 2 and messages[1]["status"] == "done"
    assert messages[1]["content"] == first_answer["content"]  # greedy: the same answer again
    tab.resend_edited(messages[0]["id"], "What is the capital of Italy?")
    result_of(qtbot, tab.request)
    messages = db.messages(tab.conversation_id)
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[0]["content"] == "What is the capital of Italy?"
    assert "Rom" in messages[1]["content"]  # Rome or Roma
    assert [w.text for w in tab.chat_view.widgets] == [m["content"] for m in messages]


def test_model_load_failure_explains_itself_and_keeps_the_window(qtbot, db, client, aio_loop, tmp_path):
    from app.main_window import MainWindow

    window = MainWindow(db, client, theme_choice="dark")
    qtbot.addWidget(window)
    window.show()
    with qtbot.waitSignal(client.model_load_failed, timeout=WAIT_MS):
        window.load_model(str(tmp_path / "missing-model"))
    assert window.banner.isVisible() and "missing-model" in window.banner_label.text()
    assert not window.current_tab().send_button.isEnabled()


def test_memory_meter_updates_every_second_with_weights_and_kv(qtbot, window):
    meter = window.memory_meter
    start = meter.num_updates
    qtbot.wait(2300)
    assert meter.num_updates - start >= 2
    report = meter.last_report
    weights = window.client.model_info["weights"]
    assert report["engine"]["weights_bytes"] == weights["resident_bytes"]
    # 135M parameters, the default load's decoder in 4-bit codes, head and table in int8: over half a byte each
    assert report["rss"] > report["engine"]["weights_bytes"] > 0.5 * 134e6
    assert set(report["engine"]["kv_bytes"]) == {"device", "host"}  # the test engine has no disk tier
    # the tiers as the engine keeps them: lossless by default, so no tier is called compressed
    assert report["engine"]["kv_quant"] == {"device": "none", "host": "none"}
    assert "KV cache: RAM " in meter.text() and "overflow RAM " in meter.text() and "compressed" not in meter.text()
    assert "overflow RAM: " in meter.toolTip() and " of " in meter.toolTip()  # budgets in the tooltip


def test_awq_toggle_is_enabled_for_the_int4_default_and_disabled_with_the_reason_for_float(qtbot, window, smollm):
    from app.dialogs import ModelDialog
    from engine.engine import layer_streaming_unavailable

    info = window.client.model_info
    # its 4-bit GGUF as 4-bit layers: int4 on an AVX-512 CPU, the file's blocks elsewhere
    assert info["weights"]["format"].startswith("gguf-q4_1") and info["layer_streaming_unavailable"] is None
    dialog = ModelDialog(window, current=None, streaming_refusal=info["layer_streaming_unavailable"])
    qtbot.addWidget(dialog)
    assert dialog.findChild(QCheckBox, "awqCheck").isEnabled()

    reason = layer_streaming_unavailable(smollm.model.config, torch.device("cpu"), "float")
    assert reason
    dialog = ModelDialog(window, current=None, streaming_refusal=reason)
    qtbot.addWidget(dialog)
    assert not dialog.findChild(QCheckBox, "awqCheck").isEnabled()
    assert reason in dialog.findChild(QLabel, "awqReason").text()


@pytest.mark.parametrize(("choice", "window_colour"), [("light", "#f3f3f5"), ("dark", "#232327")])
def test_theme_switch_recolours_and_is_remembered(qtbot, window, choice, window_colour):
    from PySide6.QtGui import QPalette

    window.set_theme("dark" if choice == "light" else "light")  # from the other theme, so the switch shows
    window.set_theme(choice)
    # The documented window colour of the theme (app/theme.py), on the window and on a widget inside it.
    assert window.palette().color(QPalette.ColorRole.Window).name() == window_colour
    assert window.current_tab().composer.palette().color(QPalette.ColorRole.Window).name() == window_colour
    assert window.current_tab().chat_view.theme == choice  # the cache map paints with this theme's colours
    assert window.theme == choice and window.db.get_setting("theme") == choice


def test_the_window_serves_its_model_over_the_openai_api(window, qtbot):
    import socket

    import openai

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    window.db.set_setting("api_server", {"enabled": False, "port": port})
    with qtbot.waitSignal(window.client.server_started, timeout=20000) as started:
        window.serve_action.trigger()
    url = started.args[0]
    assert url == f"http://127.0.0.1:{port}/v1" and window.api_label.text() == f"API: {url}"
    client = openai.OpenAI(base_url=url, api_key="-", max_retries=0, timeout=120)
    (model,) = client.models.list().data
    resp = client.chat.completions.create(model=model.id, messages=[{"role": "user", "content":
                                          "What is the capital of France?"}], temperature=0, max_tokens=12)
    assert "Paris" in resp.choices[0].message.content
    assert window.db.get_setting("api_server")["enabled"] is True
    with qtbot.waitSignal(window.client.server_stopped, timeout=20000):
        window.serve_action.trigger()
    assert window.api_label.isHidden() and window.client.server_url is None
    assert window.db.get_setting("api_server")["enabled"] is False


def test_serving_on_a_port_in_use_is_reported_and_switched_off(window, qtbot):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        window.db.set_setting("api_server", {"enabled": False, "port": busy.getsockname()[1]})
        with qtbot.waitSignal(window.client.server_failed, timeout=20000) as failed:
            window.serve_action.trigger()
    assert "in use" in failed.args[0]
    assert not window.serve_action.isChecked()
    assert "could not start" in window.banner_label.text()


def test_two_tabs_answer_at_once_in_one_batch_with_the_answers_each_gives_alone(qtbot, window):
    from PySide6.QtCore import Qt

    questions = ["Name three colors of the rainbow.", "What is two plus two?"]
    alone = []
    for question in questions:  # each alone, in a tab of its own
        tab = window.new_conversation()
        greedy(window, tab)
        alone.append(send(qtbot, tab, question).text)
    tabs = [window.new_conversation() for _ in questions]
    finished: list = []
    heard: list[list[str]] = [[], []]  # the pieces each tab's request delivered
    for i, (tab, question) in enumerate(zip(tabs, questions)):  # sent one after the other, without waiting
        greedy(window, tab)
        tab.composer.setPlainText(question)
        qtbot.keyClick(tab.composer, Qt.Key_Return)
        tab.request.token.connect(heard[i].append)
        tab.request.finished.connect(finished.append)
    assert all(tab.is_generating for tab in tabs)  # both answering at once
    qtbot.waitUntil(lambda: len(finished) == 2, timeout=WAIT_MS)
    for tab, want, pieces in zip(tabs, alone, heard):
        saved = window.db.messages(tab.conversation_id)[-1]
        assert saved["content"] == want and saved["status"] == "done"
        assert "".join(pieces) == want  # each tab heard its own answer's pieces, none of the other's
        assert saved["stats"]["batched_forwards"] > 0  # their decode steps shared forward passes


def test_a_long_question_shows_how_much_of_its_prompt_was_read_until_the_answer_starts(qtbot, window, db):
    tab = window.current_tab()
    db.update_conversation(tab.conversation_id, sampling={"temperature": 0.0, "top_p": 1.0, "max_new_tokens": 4})
    question = " ".join(f"Line {i}: the ferry leaves pier {i % 7} at {i % 12} o'clock." for i in range(60))
    read, first_token = [], []
    tab.composer.setPlainText(question + "\nWhich pier is line 3 about?")
    qtbot.keyClick(tab.composer, Qt.Key_Return)
    widget = tab.chat_view.widget_for(tab._answer_id)
    tab.request.prompt_read.connect(lambda done, total: read.append((done, total, widget.badge.text())))
    tab.request.token.connect(lambda text: first_token.append(widget.badge.text()) if not first_token else None)
    with qtbot.waitSignal(tab.request.finished, timeout=WAIT_MS):
        pass
    total = read[0][1] if read else 0
    assert total > 512 and [done for done, _, _ in read] == list(range(256, total, 256))  # a piece at a time
    assert read[0][2] == f"reading the prompt: 256 of {total:,} tokens ({100 * 256 // total}%)"
    assert first_token and not first_token[0].startswith("reading")  # gone with the first token
    assert not widget.badge.text().startswith("reading") and "tokens" in widget.badge.text()  # the stats line
