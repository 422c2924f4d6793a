"""app.db and app.paths on real SQLite files in tmp_path."""

from __future__ import annotations

import itertools
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import app.db
from app.db import DEFAULT_SAMPLING, DEFAULT_SYSTEM_PROMPT, Database, DatabaseError

REPO_ROOT = Path(__file__).resolve().parents[2]


def ticking_clock(start: float = 1_000.0):
    """Each call is one second later than the previous one, so ordering by time is deterministic."""
    return itertools.count(start).__next__


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "kvboost.sqlite3"


@pytest.fixture
def db(db_path: Path):
    database = Database(db_path, clock=ticking_clock())
    yield database
    database.close()


def add_document(db: Database, path: str, texts: list[str]) -> dict:
    passages, offset = [], 0
    for text in texts:
        passages.append({"text": text, "page": 1, "section": None, "start": offset, "end": offset + len(text)})
        offset += len(text) + 1
    return db.upsert_document(path, Path(path).name, "txt", "0" * 64, 1.0, offset, offset, passages)


# -- opening, migrations, refusal ------------------------------------------------------------------------


def test_new_database_is_migrated_to_version_1_in_wal_mode_with_foreign_keys(db: Database, db_path: Path):
    assert db.schema_version == 1 == len(app.db.MIGRATIONS)
    assert db.path == db_path
    with sqlite3.connect(db_path) as raw:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        tables = {row[0] for row in raw.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {
        "meta",
        "conversations",
        "messages",
        "documents",
        "passages",
        "conversation_documents",
        "settings",
    } <= tables
    assert {"messages_fts", "passages_fts"} <= tables
    assert db._db.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    assert db._db.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL


def test_reopening_keeps_data_and_does_not_migrate_again(db_path: Path):
    with Database(db_path) as first:
        cid = first.create_conversation("Kept")["id"]
        first.add_message(cid, "user", "still here")
        first.set_setting("theme", "dark")
    with Database(db_path) as second:
        assert second.schema_version == 1
        assert second.conversation(cid)["title"] == "Kept"
        assert [m["content"] for m in second.messages(cid)] == ["still here"]
        assert second.get_setting("theme") == "dark"


def test_database_with_newer_schema_version_is_refused_and_left_untouched(db_path: Path):
    Database(db_path).close()
    with sqlite3.connect(db_path) as raw:
        raw.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    # Back to rollback-journal mode, so switching the file to WAL would show up in its header bytes.
    raw.execute("PRAGMA journal_mode = DELETE")
    raw.close()
    before = db_path.read_bytes()
    with pytest.raises(DatabaseError, match="schema version 99") as excinfo:
        Database(db_path)
    assert isinstance(excinfo.value, RuntimeError)
    assert str(db_path) in str(excinfo.value)
    assert db_path.read_bytes() == before


def test_garbage_file_is_refused_with_its_path(db_path: Path):
    db_path.write_bytes(b"this is not a database, just text that is long enough to look like a header" * 20)
    with pytest.raises(DatabaseError) as excinfo:
        Database(db_path)
    assert str(db_path) in str(excinfo.value)


def test_sqlite_file_of_another_program_is_refused(db_path: Path):
    with sqlite3.connect(db_path) as raw:
        raw.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY)")
    raw.close()
    with pytest.raises(DatabaseError, match="not a KVBoost database"):
        Database(db_path)


def test_failing_migration_leaves_the_file_at_its_previous_version(db_path: Path, monkeypatch):
    Database(db_path).close()

    def broken_migration(sdb):
        sdb.execute("CREATE TABLE half_done (x INTEGER)")
        raise RuntimeError("migration bug")

    monkeypatch.setattr(app.db, "MIGRATIONS", [*app.db.MIGRATIONS, broken_migration])
    with pytest.raises(RuntimeError, match="migration bug"):
        Database(db_path)
    monkeypatch.undo()
    with Database(db_path) as reopened:
        assert reopened.schema_version == 1
        assert "half_done" not in reopened._db.table_names()


# -- conversations ---------------------------------------------------------------------------------------


def test_new_conversation_has_defaults_and_goes_to_the_end_of_the_tab_strip(db: Database):
    first = db.create_conversation()
    second = db.create_conversation("Second", system_prompt="Be terse.", sampling={"temperature": 0.2})
    assert first["title"] == "New chat"
    assert first["system_prompt"] == DEFAULT_SYSTEM_PROMPT
    assert first["sampling"] == DEFAULT_SAMPLING
    assert (first["is_open"], first["tab_order"]) == (1, 0)
    assert second["sampling"] == {**DEFAULT_SAMPLING, "temperature": 0.2}
    assert (second["system_prompt"], second["tab_order"]) == ("Be terse.", 1)
    assert db.conversation(second["id"]) == second


def test_missing_conversation_raises_key_error(db: Database):
    with pytest.raises(KeyError):
        db.conversation(42)
    with pytest.raises(KeyError):
        db.update_conversation(42, title="x")
    with pytest.raises(KeyError):
        db.delete_conversation(42)


def test_update_conversation_changes_fields_and_bumps_updated_at(db: Database):
    created = db.create_conversation()
    updated = db.update_conversation(created["id"], title="Renamed", sampling={"top_p": 0.5}, system_prompt="Hi")
    assert updated["title"] == "Renamed"
    assert updated["system_prompt"] == "Hi"
    assert updated["sampling"] == {**DEFAULT_SAMPLING, "top_p": 0.5}
    assert updated["updated_at"] > created["updated_at"]
    assert updated["created_at"] == created["created_at"]


@pytest.mark.parametrize(
    "fields", [{"colour": "red"}, {"id": 7}, {"sampling": {"beam_width": 4}}, {"sampling": {"max_new_tokens": 0}}]
)
def test_update_conversation_rejects_unknown_or_bad_fields(db: Database, fields: dict):
    cid = db.create_conversation("Same")["id"]
    with pytest.raises(ValueError):
        db.update_conversation(cid, **fields)
    assert db.conversation(cid)["title"] == "Same"


def test_open_tabs_follow_tab_order_and_history_follows_updated_at(db: Database):
    a, b, c = (db.create_conversation(title)["id"] for title in "abc")
    db.set_tab_order([c, a, b])
    assert [conv["id"] for conv in db.conversations(open_only=True)] == [c, a, b]
    db.update_conversation(b, is_open=0)
    assert [conv["id"] for conv in db.conversations(open_only=True)] == [c, a]
    db.add_message(a, "user", "most recent activity")
    assert [conv["id"] for conv in db.conversations()] == [a, b, c]


def test_reopening_a_closed_conversation_puts_its_tab_last(db: Database):
    a, b, c = (db.create_conversation(title)["id"] for title in "abc")
    db.update_conversation(a, is_open=False)
    db.update_conversation(a, is_open=True)
    assert [conv["id"] for conv in db.conversations(open_only=True)] == [b, c, a]


def test_set_tab_order_with_unknown_id_changes_nothing(db: Database):
    a, b = (db.create_conversation(title)["id"] for title in "ab")
    with pytest.raises(KeyError):
        db.set_tab_order([b, 999, a])
    assert [conv["id"] for conv in db.conversations(open_only=True)] == [a, b]


def test_deleting_a_conversation_deletes_its_messages_and_attachments(db: Database):
    cid = db.create_conversation()["id"]
    mid = db.add_message(cid, "user", "ephemeral words")["id"]
    doc = add_document(db, "/docs/a.txt", ["some text"])
    db.attach_document(cid, doc["id"])
    db.delete_conversation(cid)
    assert db.conversations() == []
    with pytest.raises(KeyError):
        db.message(mid)
    assert db.search_messages("ephemeral") == []
    assert db._db.execute("SELECT COUNT(*) FROM conversation_documents").fetchone()[0] == 0
    assert db.find_document("/docs/a.txt") is not None


# -- messages --------------------------------------------------------------------------------------------


def test_messages_are_numbered_in_order_and_decode_json_columns(db: Database):
    cid = db.create_conversation()["id"]
    db.add_message(cid, "system", "rules")
    db.add_message(cid, "user", "question")
    answer = db.add_message(
        cid, "assistant", "answer", stats={"tokens_per_s": 41.5}, sources=[{"document_id": 3, "page": 2}]
    )
    assert [(m["position"], m["role"], m["content"]) for m in db.messages(cid)] == [
        (0, "system", "rules"),
        (1, "user", "question"),
        (2, "assistant", "answer"),
    ]
    assert answer["stats"] == {"tokens_per_s": 41.5}
    assert answer["sources"] == [{"document_id": 3, "page": 2}]
    assert db.messages(cid)[0]["stats"] is None


def test_add_message_bumps_conversation_updated_at(db: Database):
    conversation = db.create_conversation()
    message = db.add_message(conversation["id"], "user", "hi")
    assert db.conversation(conversation["id"])["updated_at"] == message["created_at"] > conversation["updated_at"]


@pytest.mark.parametrize("role, status", [("robot", "done"), ("user", "finished"), ("USER", "done")])
def test_add_message_rejects_unknown_role_or_status(db: Database, role: str, status: str):
    cid = db.create_conversation()["id"]
    with pytest.raises(ValueError):
        db.add_message(cid, role, "text", status=status)
    assert db.messages(cid) == []


def test_add_message_to_missing_conversation_raises_key_error(db: Database):
    with pytest.raises(KeyError):
        db.add_message(7, "user", "orphan")


def test_update_message_changes_only_given_fields(db: Database):
    cid = db.create_conversation()["id"]
    mid = db.add_message(cid, "assistant", "", status="streaming")["id"]
    db.update_message(mid, content="partial")
    assert (db.message(mid)["content"], db.message(mid)["status"]) == ("partial", "streaming")
    done = db.update_message(mid, content="partial answer", status="done", stats={"num_tokens": 2})
    assert (done["content"], done["status"], done["stats"]) == ("partial answer", "done", {"num_tokens": 2})
    with pytest.raises(KeyError):
        db.update_message(999, content="x")


def test_message_prompt_records_the_text_sent_to_the_model(db: Database):
    cid = db.create_conversation()["id"]
    user = db.add_message(cid, "user", "What does it say?")
    assert user["prompt"] is None
    updated = db.update_message(user["id"], prompt="[notes.txt]\nIt says hi.\n\nWhat does it say?")
    assert (updated["content"], updated["prompt"]) == (
        "What does it say?",
        "[notes.txt]\nIt says hi.\n\nWhat does it say?",
    )


def test_delete_messages_from_removes_that_position_and_later(db: Database):
    cid = db.create_conversation()["id"]
    for index in range(5):
        db.add_message(cid, "user" if index % 2 == 0 else "assistant", f"m{index}")
    assert db.delete_messages_from(cid, 2) == 3
    assert [m["content"] for m in db.messages(cid)] == ["m0", "m1"]
    assert db.add_message(cid, "user", "resent")["position"] == 2


def test_mark_interrupted_turns_streaming_answers_into_interrupted(db: Database):
    cid = db.create_conversation()["id"]
    done = db.add_message(cid, "user", "q")["id"]
    first = db.add_message(cid, "assistant", "half", status="streaming")["id"]
    second = db.add_message(cid, "assistant", "also half", status="streaming")["id"]
    assert db.mark_interrupted() == 2
    assert [db.message(mid)["status"] for mid in (done, first, second)] == ["done", "interrupted", "interrupted"]
    assert db.mark_interrupted() == 0


def test_message_written_before_the_process_is_killed_survives(db_path: Path):
    script = textwrap.dedent(
        f"""
        import os
        from app.db import Database
        db = Database({str(db_path)!r})
        cid = db.create_conversation("Crash")["id"]
        mid = db.add_message(cid, "assistant", "", status="streaming")["id"]
        db.update_message(mid, content="every token so far", status="streaming")
        os._exit(1)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, timeout=60)
    assert result.returncode == 1, result.stderr.decode()
    with Database(db_path) as reopened:
        assert reopened.mark_interrupted() == 1
        (conversation,) = reopened.conversations()
        (message,) = reopened.messages(conversation["id"])
        assert (message["content"], message["status"]) == ("every token so far", "interrupted")


# -- message search --------------------------------------------------------------------------------------


def test_search_finds_stemmed_words_and_marks_them_in_the_snippet(db: Database):
    cid = db.create_conversation("Runner")["id"]
    db.add_message(cid, "user", "I was running late for the meeting")
    db.add_message(cid, "assistant", "Nothing relevant here")
    (hit,) = db.search_messages("runs meeting")
    assert (hit["conversation_id"], hit["title"], hit["role"], hit["position"]) == (cid, "Runner", "user", 0)
    assert "\x02running\x03" in hit["snippet"] and "\x02meeting\x03" in hit["snippet"]


def test_search_needs_every_word_and_ranks_denser_matches_first(db: Database):
    cid = db.create_conversation()["id"]
    sparse = db.add_message(cid, "user", "cache " + "filler " * 30)["id"]
    dense = db.add_message(cid, "user", "cache cache cache eviction")["id"]
    db.add_message(cid, "user", "eviction only")
    assert [hit["message_id"] for hit in db.search_messages("cache")] == [dense, sparse]
    assert [hit["message_id"] for hit in db.search_messages("cache eviction")] == [dense]


def test_search_follows_updates_and_deletes(db: Database):
    cid = db.create_conversation()["id"]
    mid = db.add_message(cid, "assistant", "apples")["id"]
    db.update_message(mid, content="oranges")
    assert db.search_messages("apples") == []
    assert [hit["message_id"] for hit in db.search_messages("oranges")] == [mid]
    db.delete_messages_from(cid, 0)
    assert db.search_messages("oranges") == []


@pytest.mark.parametrize("query", ['"', "AND (", "*", "NOT", "OR OR", "NEAR(", "content:x", "^", "   ", "", '"""'])
def test_search_never_raises_on_fts_syntax(db: Database, query: str):
    cid = db.create_conversation()["id"]
    db.add_message(cid, "user", "plain words")
    assert db.search_messages(query) == []


def test_search_treats_operators_and_punctuation_as_text(db: Database):
    cid = db.create_conversation()["id"]
    hyphen = db.add_message(cid, "user", "the foo-bar module")["id"]
    db.add_message(cid, "user", "bar then foo")
    conjunction = db.add_message(cid, "user", "salt AND pepper")["id"]
    assert [hit["message_id"] for hit in db.search_messages("foo-bar")] == [hyphen]
    assert [hit["message_id"] for hit in db.search_messages("and pepper")] == [conjunction]


# -- documents -------------------------------------------------------------------------------------------


def test_upserting_a_document_again_replaces_its_passages_and_keeps_its_id(db: Database):
    cid = db.create_conversation()["id"]
    original = add_document(db, "/docs/notes.txt", ["old first", "old second", "old third"])
    db.attach_document(cid, original["id"])
    reindexed = add_document(db, "/docs/notes.txt", ["new only"])
    assert reindexed["id"] == original["id"]
    assert reindexed["added_at"] == original["added_at"]
    assert [(p["seq"], p["text"]) for p in db.passages(original["id"])] == [(0, "new only")]
    assert [d["id"] for d in db.conversation_documents(cid)] == [original["id"]]
    assert db.search_passages(cid, "old") == []
    assert [p["text"] for p in db.search_passages(cid, "new")] == ["new only"]


def test_touched_but_unchanged_document_only_gets_a_new_signature(db: Database):
    doc = add_document(db, "/docs/same.txt", ["same words"])
    refreshed = db.upsert_document_signature(doc["id"], mtime=2.5, size=99)
    assert (refreshed["id"], refreshed["mtime"], refreshed["size"], refreshed["sha256"]) == (
        doc["id"],
        2.5,
        99,
        doc["sha256"],
    )
    assert [p["text"] for p in db.passages(doc["id"])] == ["same words"]
    with pytest.raises(KeyError):
        db.upsert_document_signature(999, 1.0, 1)


def test_find_document_returns_none_for_an_unknown_path(db: Database):
    assert db.find_document("/nowhere.pdf") is None


def test_bad_passage_rejects_the_whole_upsert(db: Database):
    with pytest.raises(ValueError, match="passage 1"):
        db.upsert_document("/d.txt", "d.txt", "txt", "0", 1.0, 1, 1, [{"text": "ok", "start": 0, "end": 2}, {}])
    assert db.find_document("/d.txt") is None


def test_attached_documents_keep_attachment_order(db: Database):
    cid = db.create_conversation()["id"]
    first = add_document(db, "/docs/b.txt", ["b"])
    second = add_document(db, "/docs/a.txt", ["a"])
    db.attach_document(cid, second["id"])
    db.attach_document(cid, first["id"])
    db.attach_document(cid, second["id"])  # already attached: no change
    assert [(d["name"], d["position"]) for d in db.conversation_documents(cid)] == [("a.txt", 0), ("b.txt", 1)]
    db.detach_document(cid, second["id"])
    assert [d["name"] for d in db.conversation_documents(cid)] == ["b.txt"]
    with pytest.raises(KeyError):
        db.attach_document(cid, 999)


def test_passage_search_only_sees_documents_attached_to_the_conversation(db: Database):
    cid = db.create_conversation()["id"]
    other_cid = db.create_conversation()["id"]
    attached = add_document(db, "/docs/attached.txt", ["the eviction policy of the store"])
    unattached = add_document(db, "/docs/unattached.txt", ["eviction policy eviction policy"])
    db.attach_document(cid, attached["id"])
    db.attach_document(other_cid, unattached["id"])
    hits = db.search_passages(cid, "eviction policy")
    assert [(hit["document_id"], hit["name"], hit["path"]) for hit in hits] == [
        (attached["id"], "attached.txt", "/docs/attached.txt")
    ]
    db.detach_document(cid, attached["id"])
    assert db.search_passages(cid, "eviction policy") == []


def test_passage_search_ranks_the_passage_with_more_question_terms_first(db: Database):
    cid = db.create_conversation()["id"]
    doc = add_document(
        db,
        "/docs/manual.txt",
        [
            "The cache keeps recent chunks on the device for quick reuse later on.",
            "The cache eviction policy drops the least recently used chunks first.",
            "Tokenizers split text into ids before the model sees anything at all.",
        ],
    )
    db.attach_document(cid, doc["id"])
    hits = db.search_passages(cid, "What is the cache eviction policy?")
    assert [hit["text"].split()[1:3] for hit in hits] == [["cache", "eviction"], ["cache", "keeps"]]
    assert hits[0]["score"] > hits[1]["score"]
    assert (hits[0]["page"], hits[0]["start"], hits[0]["end"]) == (1, 70, 70 + len(hits[0]["text"]))


@pytest.mark.parametrize("query", ["what is the?", "a b c", "", '" AND ( *'])
def test_passage_search_without_content_words_finds_nothing(db: Database, query: str):
    cid = db.create_conversation()["id"]
    doc = add_document(db, "/docs/x.txt", ["what is the a b c AND"])
    db.attach_document(cid, doc["id"])
    assert db.search_passages(cid, query) == []


# -- settings --------------------------------------------------------------------------------------------


def test_settings_store_json_values_and_fall_back_to_the_default(db: Database):
    assert db.get_setting("model", default="embedded") == "embedded"
    db.set_setting("model", {"source": "/models/x.gguf", "dtype": None})
    db.set_setting("recent", [1, 2])
    db.set_setting("recent", [3])
    assert db.get_setting("model") == {"source": "/models/x.gguf", "dtype": None}
    assert db.get_setting("recent") == [3]
    with pytest.raises(ValueError):
        db.set_setting("bad", object())
