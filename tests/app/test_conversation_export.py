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


@pytest.mark.parametrize("title", ["What is 2+2?", 'a/b\\c: "d" <e>|*', "...", "CON", "x" * 300, "  hi.  ",
                                   "tab\there\nnew line", "nul", "?", "résumé · 東京"])
def test_an_export_is_offered_under_a_name_every_desktop_accepts(tmp_path, title):
    from app.conversation_export import MAX_NAME_CHARS, suggested_path

    path = suggested_path(tmp_path, title, "md")
    name = path.name
    assert path.parent == tmp_path and name.endswith(".md")
    stem = name[:-3]
    assert stem and len(stem) <= MAX_NAME_CHARS
    assert not set(stem) & set('<>:"/\\|?*') and all(ord(c) >= 32 and c != "\x7f" for c in stem)
    assert stem == stem.strip(" .") and stem.lower() not in ("con", "nul")
    path.write_text("written")  # the file system takes it
    assert path.read_text() == "written"


def test_exports_carry_the_documents_the_sources_and_the_answering_model(db: Database, tmp_path):
    cid = make_conversation_with_messages(db)
    doc = db.upsert_document(str(tmp_path / "guide.pdf"), "guide.pdf", "pdf", "ab" * 32, 1.0, 10, 15,
                             [{"text": "Lisbon is warm.", "page": 4, "section": None, "start": 0, "end": 15}])
    db.attach_document(cid, doc["id"])
    db.add_message(cid, "user", "And in winter?")
    db.add_message(cid, "assistant", "Still mild.", stats={"model": "Qwen2.5-7B-Instruct-Q4_K_M.gguf"},
                   sources=[{"name": "guide.pdf", "page": 4, "text": "Lisbon is warm."}])
    exported = export_json(db, cid)
    assert [(d["name"], d["path"]) for d in exported["documents"]] == [("guide.pdf", str(tmp_path / "guide.pdf"))]
    assert exported["messages"][-1]["stats"]["model"] == "Qwen2.5-7B-Instruct-Q4_K_M.gguf"
    markdown = export_markdown(db, cid)
    assert f"Documents:\n- guide.pdf ({tmp_path / 'guide.pdf'})" in markdown
    assert "Still mild.\n\n*Model: Qwen2.5-7B-Instruct-Q4_K_M.gguf*\n*Sources: guide.pdf p.4*" in markdown
    assert import_json(db, exported)["id"] != cid  # an export with documents still imports
