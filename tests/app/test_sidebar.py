"""The sidebar groups conversations under date headings, and renames or deletes one from a right click; a
conversation without messages shows which model answers and starter prompts that send themselves."""

from __future__ import annotations

import datetime
import time

import pytest
from PySide6.QtCore import Qt
from qt_helpers import result_of

from app.empty_state import STARTERS
from app.sidebar import GROUPS, Sidebar, date_group

NOON = time.mktime(datetime.datetime(2026, 3, 10, 12, 0).timetuple())  # local time
DAY = 86400


@pytest.mark.parametrize("days_before, group", [
    (0, "Today"), (-0.2, "Today"), (1, "Yesterday"), (2, "Previous 7 days"), (7, "Previous 7 days"),
    (8, "Previous 30 days"), (30, "Previous 30 days"), (31, "Older"), (400, "Older"),
])
def test_a_conversation_sits_under_the_heading_of_its_last_update(days_before, group):
    assert date_group(NOON - days_before * DAY, NOON) == group


def test_yesterday_is_the_calendar_day_before_not_24_hours():
    late = time.mktime(datetime.datetime(2026, 3, 10, 0, 30).timetuple())
    assert date_group(late - 3600, late) == "Yesterday"  # an hour ago, before midnight


def rows(sidebar: Sidebar) -> list:
    items = [sidebar.conversation_list.item(i) for i in range(sidebar.conversation_list.count())]
    return [(item.text().split("\n")[0], item.data(Qt.UserRole), item.flags()) for item in items]


def test_headings_separate_the_days_and_do_nothing_when_clicked(qtbot, tmp_path):
    from app.db import Database

    clock = [NOON - 40 * DAY]
    db = Database(tmp_path / "kvboost.sqlite3", clock=lambda: clock[0])
    ids = {}
    for title, days in (("old", 40), ("last week", 5), ("yesterday", 1), ("this morning", 0.1), ("now", 0)):
        clock[0] = NOON - days * DAY
        ids[title] = db.create_conversation(title=title)["id"]
    opened = []
    sidebar = Sidebar(db, lambda cid, mid: opened.append(cid), clock=lambda: NOON)
    qtbot.addWidget(sidebar)
    sidebar.refresh(set(ids.values()), ids["now"])
    got = rows(sidebar)
    assert [text for text, _, _ in got] == ["Today", "now", "this morning", "Yesterday", "yesterday",
                                            "Previous 7 days", "last week", "Older", "old"]
    headings = [(text, flags) for text, target, flags in got if target is None]
    assert [text for text, _ in headings] == [g for g in GROUPS if g != "Previous 30 days"]
    assert all(not flags & Qt.ItemIsSelectable and not flags & Qt.ItemIsEnabled for _, flags in headings)
    sidebar.on_item_activated(sidebar.conversation_list.item(0))  # a heading
    sidebar.on_item_activated(sidebar.conversation_list.item(1))
    assert opened == [ids["now"]]
    db.close()


def test_a_right_click_offers_open_rename_and_delete_for_conversations_only(qtbot, tmp_path):
    from app.db import Database

    db = Database(tmp_path / "kvboost.sqlite3")
    cid = db.create_conversation(title="Trip")["id"]
    calls = []
    sidebar = Sidebar(db, lambda c, m: calls.append(("open", c)), lambda c: calls.append(("rename", c)),
                      lambda c: calls.append(("delete", c)))
    qtbot.addWidget(sidebar)
    sidebar.refresh({cid}, cid)
    heading, item = sidebar.conversation_list.item(0), sidebar.conversation_list.item(1)
    assert sidebar.context_menu_for(heading) is None and sidebar.context_menu_for(None) is None
    menu = sidebar.context_menu_for(item)
    actions = {a.text(): a for a in menu.actions()}
    assert list(actions) == ["Open", "Rename…", "Delete…"]
    for name in ("Rename…", "Delete…", "Open"):
        actions[name].trigger()
    assert calls == [("rename", cid), ("delete", cid), ("open", cid)]
    db.close()


def test_rename_and_delete_from_the_sidebar_reach_the_tab_and_the_database(qtbot, window):
    db = window.db
    tab = window.current_tab()
    other = window.new_conversation()
    db.add_message(other.conversation_id, "user", "a message to lose")
    window.rename_conversation(tab.conversation_id, "Renamed")
    assert window.tabs.tabText(window.tabs.indexOf(tab)) == "Renamed"
    assert db.conversation(tab.conversation_id)["title"] == "Renamed"
    assert not window.delete_conversation(other.conversation_id, confirmed=False)  # the user said No
    assert window.tab_for(other.conversation_id) is not None
    assert window.delete_conversation(other.conversation_id, confirmed=True)
    assert window.tab_for(other.conversation_id) is None
    with pytest.raises(KeyError):
        db.conversation(other.conversation_id)
    titles = [window.conversation_list.item(i).text() for i in range(window.conversation_list.count())]
    assert any(t.startswith("Renamed") for t in titles) and len(titles) == 2  # "Today" and the one left


def test_an_empty_conversation_names_the_model_and_a_starter_sends_itself(qtbot, window):
    tab = window.new_conversation()
    state = tab.chat_view.empty_state
    assert state.isVisibleTo(tab) and "SmolLM2" in state.title.text()
    button = state.buttons[0]
    qtbot.mouseClick(button, Qt.LeftButton)
    result_of(qtbot, tab.request, timeout=120_000)
    messages = window.db.messages(tab.conversation_id)
    assert messages[0]["role"] == "user" and messages[0]["content"] == STARTERS[0][1]
    assert not state.isVisibleTo(tab)


def test_text_size_grows_shrinks_resets_and_is_kept(qtbot, window):
    from PySide6.QtWidgets import QApplication

    from app import settings

    base = window.text_size.base
    larger, smaller, normal = window.text_size.actions
    assert "Ctrl+=" in [k.toString() for k in larger.shortcuts()]
    larger.trigger()
    larger.trigger()
    assert QApplication.font().pointSizeF() == pytest.approx(base * 1.21)
    assert settings.load(window.db).text_size == 2
    for _ in range(20):  # held down: stops at the smallest size the settings allow
        smaller.trigger()
    assert settings.load(window.db).text_size == settings.TEXT_SIZES[0]
    assert QApplication.font().pointSizeF() == pytest.approx(base * 1.1 ** settings.TEXT_SIZES[0])
    normal.trigger()
    assert QApplication.font().pointSizeF() == pytest.approx(base) and settings.load(window.db).text_size == 0


def test_a_stored_text_size_out_of_range_reads_as_the_default(db):
    from app import settings

    db.set_settings({"schema_version": settings.SCHEMA_VERSION, "text_size": 99})
    assert settings.load(db).text_size == 0
    db.set_settings({"schema_version": settings.SCHEMA_VERSION, "text_size": True})
    assert settings.load(db).text_size == 0
