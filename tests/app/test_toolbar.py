"""The main window's toolbar and sidebar: New chat, the model picker (recent models, one click to switch), the
context gauge of the conversation on screen, and the sidebar highlighting that conversation."""

from __future__ import annotations

from PySide6.QtCore import Qt
from qt_helpers import WAIT_MS
from tiny_models import build_model, build_tokenizer  # noqa: E402  (before an engine thread imports transformers)

from app import settings
from app.settings import ModelChoice
from app.toolbar import OTHER_MODEL, WARN_SHARE


def test_new_chat_opens_a_conversation_and_the_sidebar_highlights_the_one_on_screen(qtbot, idle_window):
    window = idle_window
    first = window.current_tab()
    before = window.tabs.count()
    window.toolbar.widgetForAction(window.new_action).click()
    assert window.tabs.count() == before + 1 and window.current_tab() is not first
    bold = [window.conversation_list.item(i) for i in range(window.conversation_list.count())
            if window.conversation_list.item(i).font().bold()]
    assert len(bold) == 1 and bold[0].data(Qt.UserRole)[0] == window.current_tab().conversation_id
    assert window.conversation_list.currentItem() is bold[0]
    window.tabs.setCurrentWidget(first)
    bold = [window.conversation_list.item(i) for i in range(window.conversation_list.count())
            if window.conversation_list.item(i).font().bold()]
    assert len(bold) == 1 and bold[0].data(Qt.UserRole)[0] == first.conversation_id


def test_the_model_picker_lists_recent_models_and_switches_in_one_click(qtbot, idle_window, tmp_path):
    window = idle_window
    folder = tmp_path / "tiny"
    build_model("llama").save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    settings.update(window.db, recent_models=(ModelChoice(source=str(folder), reuse="off"),))
    window.toolbar.fill_model_picker()
    picker = window.toolbar.model_picker
    labels = [picker.itemText(i) for i in range(picker.count())]
    assert labels[0].endswith("(built in)") and "tiny" in labels and labels[-1] == OTHER_MODEL
    with qtbot.waitSignal(window.client.model_loaded, timeout=WAIT_MS) as loaded:
        picker.activated.emit(labels.index("tiny"))
    assert loaded.args[0]["source"] == str(folder)
    assert picker.itemText(0) == "tiny"  # the loaded model comes first
    assert settings.load(window.db).model.source == str(folder)


def test_the_gauge_shows_the_conversations_share_of_the_context_and_warns_before_it_overflows(idle_window):
    window = idle_window
    toolbar = window.toolbar
    toolbar.show_loaded({"max_context": 2048, "name": "m"})
    tab = window.current_tab()
    toolbar.follow(tab.conversation_id)
    assert toolbar.context_gauge.value() == 0 and toolbar.context_gauge.maximum() == 2048
    window.db.add_message(tab.conversation_id, "user", "hello")
    answer = window.db.add_message(tab.conversation_id, "assistant", "hi")
    window.db.update_message(answer["id"], stats={"prompt_tokens": 1000, "generated_tokens": 24})
    toolbar.follow(tab.conversation_id)
    assert toolbar.context_gauge.value() == 1024 and "1,024 / 2,048 tokens" == toolbar.context_gauge.format()
    assert not toolbar.context_gauge.property("warning")
    window.db.update_message(answer["id"], stats={"prompt_tokens": int(2048 * WARN_SHARE), "generated_tokens": 10})
    toolbar.follow(tab.conversation_id)
    assert toolbar.context_gauge.property("warning") and "new chat" in toolbar.context_gauge.toolTip()


def test_search_hits_show_their_matches_in_bold_not_between_brackets(qtbot, idle_window):
    window = idle_window
    db = window.db
    other = db.create_conversation(title="Garden <notes>")
    db.add_message(other["id"], "user", "When do [tulips] bloom? <b>soon</b>")
    qtbot.keyClicks(window.search_edit, "tulips")
    item = window.conversation_list.item(0)
    label = window.conversation_list.itemWidget(item)
    assert "<b>tulips</b>" in label.text() and "[<b>tulips</b>]" in label.text()  # its own brackets stay
    assert "&lt;b&gt;soon&lt;/b&gt;" in label.text() and "Garden &lt;notes&gt;" in label.text()
    assert "\x02" not in item.text() and "tulips" in item.text()
