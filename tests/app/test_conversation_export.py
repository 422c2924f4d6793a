"""Conversations as files: JSON export/import round trip, validation before writing, Markdown export."""

from __future__ import annotations

import pytest

from app.conversation_export import export_json, export_markdown, import_json
from app.db import DEFAULT_SAMPLING, DEFAULT_SYSTEM_PROMPT, Database


def make_conversation_with_messages(db: Database) -> int:
    cid = db.create_conversation("Trip plan", system_prompt="You plan trips.\nBe brief.", sampling={"top_p": 0.8})["id"]
    db.add_message(cid, "user", "Where should I go?\n\n- somewhere *warm*")
    db.add_message(cid, "assistant", "Try Lisbon.", stats={"tokens_per_s": 30.0}, sources=[{"page": 4}])
    return cid


def test_export_then_import_reproduces_the_conversation(db: Database):
    cid = make_conversation_with_messages(db)
    exported = export_json(db, cid)
    assert (exported["format"], exported["version"]) == ("kvboost-conversation", 1)
    imported = import_json(db, exported)
    assert imported["id"] != cid
    assert export_json(db, imported["id"]) == exported
    assert [conv["id"] for conv in db.conversations(open_only=True)] == [cid, imported["id"]]


def test_export_markdown_contains_title_prompt_and_messages_verbatim(db: Database):
    cid = make_conversation_with_messages(db)
    markdown = export_markdown(db, cid)
    assert markdown.startswith("# Trip plan\n\n> You plan trips.\n> Be brief.\n\n")
    assert "**User**\n\nWhere should I go?\n\n- somewhere *warm*\n\n**Assistant**\n\nTry Lisbon.\n" in markdown


def good_export() -> dict:
    return {
        "format": "kvboost-conversation",
        "version": 1,
        "title": "t",
        "messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}],
    }


@pytest.mark.parametrize(
    "data, message",
    [
        ([], "JSON object"),
        ({**good_export(), "format": "chatgpt"}, "format"),
        ({**good_export(), "version": 2}, "version 2"),
        ({k: v for k, v in good_export().items() if k != "messages"}, "'messages' list"),
        ({**good_export(), "messages": [{"role": "user", "content": "ok"}, {"role": "tool", "content": "x"}]}, "tool"),
        ({**good_export(), "messages": [{"role": "user", "content": ["not", "text"]}]}, "content"),
        ({**good_export(), "messages": ["hello"]}, "message 0"),
        ({**good_export(), "sampling": {"temperature": "hot"}}, "temperature"),
        ({**good_export(), "title": 5}, "title"),
    ],
)
def test_import_rejects_bad_input_without_writing(db: Database, data, message: str):
    make_conversation_with_messages(db)
    with pytest.raises(ValueError, match=message):
        import_json(db, data)
    assert len(db.conversations()) == 1
    assert db._db.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 2


def test_import_of_a_minimal_export_uses_defaults(db: Database):
    imported = import_json(db, good_export())
    assert (imported["title"], imported["system_prompt"], imported["sampling"]) == (
        "t",
        DEFAULT_SYSTEM_PROMPT,
        DEFAULT_SAMPLING,
    )
    assert [(m["role"], m["content"], m["status"]) for m in db.messages(imported["id"])] == [
        ("user", "hello", "done"),
        ("assistant", "hi", "done"),
    ]
