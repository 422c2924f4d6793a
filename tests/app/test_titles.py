"""A new conversation takes its title from its first question; a renamed one keeps its name."""

from __future__ import annotations

import pytest
from qt_helpers import send

from app.db_values import TITLE_CHARS, title_from_question


@pytest.mark.parametrize("question, title", [
    ("What is the capital of France?", "What is the capital of France?"),
    ("  Summarise\n\nthis   report  ", "Summarise this report"),
    ("Please compare the two attached quarterly reports and list every difference",
     "Please compare the two attached quarterly…"),
    ("x" * 80, "x" * TITLE_CHARS + "…"),
])
def test_a_title_is_the_question_s_opening_words(question, title):
    assert title_from_question(question) == title
    assert len(title_from_question(question)) <= TITLE_CHARS + 1


def test_the_first_question_names_the_conversation_and_a_rename_sticks(qtbot, window, db):
    tab = window.current_tab()
    db.update_conversation(tab.conversation_id, sampling={"temperature": 0.0, "top_p": 1.0, "max_new_tokens": 4})
    send(qtbot, tab, "What is the capital of France?")
    assert window.tabs.tabText(window.tabs.indexOf(tab)) == "What is the capital of France?"
    assert db.conversation(tab.conversation_id)["title"] == "What is the capital of France?"
    assert window.conversation_list.item(0).text() == "Today"  # a heading, then the day's conversations
    assert window.conversation_list.item(1).text().startswith("What is the capital of France?")

    window.rename_tab(window.tabs.indexOf(tab), "Geography")
    send(qtbot, tab, "And of Spain?")
    assert window.tabs.tabText(window.tabs.indexOf(tab)) == "Geography"
    assert db.conversation(tab.conversation_id)["title"] == "Geography"
