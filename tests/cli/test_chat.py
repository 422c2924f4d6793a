"""`kvboost chat` with documents: the conversations the terminal keeps (the app's database and prompt layouts), and
the real command as a user types into it."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from app.db import Database, DatabaseLocked
from cli.chat import Conversation, _open, command_of

ROOT = Path(__file__).resolve().parents[2]
NOTE = "# Harbour note\n\nThe ferry to the island leaves at 7:40 every morning from pier 3. A ticket costs 12 crowns.\n"


def test_typed_lines_are_commands_only_when_they_start_with_one_slash():
    assert command_of("/file notes.md") == "/file"
    assert command_of("/frobnicate") == "/frobnicate"
    assert command_of("//etc is a folder?") is None
    assert command_of("What is /etc?") is None


def long_document(path: Path) -> Path:
    """~50 KB of sections, one of them the only one about a lighthouse."""
    words = "harbour ferry island ticket crown pier morning evening market bridge tower lantern captain cargo".split()
    sections = [f"## Section {i}\n\n" + " ".join(words[(i * 7 + j) % len(words)] for j in range(120)) + ".\n"
                for i in range(60)]
    sections.insert(31, "## Lighthouse\n\nThe lighthouse keeper's code is 48213.\n")
    path.write_text("\n".join(sections), encoding="utf-8")
    return path


def test_a_short_document_is_kept_whole_in_the_system_message(tmp_path):
    note = tmp_path / "note.md"
    note.write_text(NOTE, encoding="utf-8")
    conversation = Conversation(Database(tmp_path / "chat.db"), None, max_context=8192)
    try:
        report = conversation.add(str(note))
        assert report == {"added": 1, "unchanged": 0, "problems": []}
        assert conversation.add(str(note))["added"] == 0  # the same file again: nothing new
        messages, _, _ = conversation.ask("When does the ferry leave?")
        assert messages[0]["role"] == "system" and "leaves at 7:40 every morning" in messages[0]["content"]
        assert messages[-1] == {"role": "user", "content": "When does the ferry leave?"}
        # what the next question's prompt starts with is what /file reads into the cache
        assert conversation.warm_inputs(approximate=False)[-1] == messages[:1]
    finally:
        conversation.db.close()


def test_a_long_document_sends_each_question_its_passages(tmp_path):
    conversation = Conversation(Database(tmp_path / "chat.db"), None, max_context=8192)
    try:
        assert conversation.add(str(long_document(tmp_path / "harbour.md")))["added"] == 1
        messages, sources, user = conversation.ask("What is the lighthouse keeper's code?")
        assert "48213" not in messages[0]["content"]  # not whole in the system message: too long for the context
        assert "48213" in messages[-1]["content"] and "What is the lighthouse keeper's code?" in messages[-1]["content"]
        assert any("48213" in s["text"] for s in sources)
        conversation.answered("48213", sources)
        # the next question resends the first one as it was sent, passages and all, and not its passage again
        again, _, _ = conversation.ask("And the ferry?")
        assert again[1]["content"] == messages[-1]["content"]
        assert "48213" not in again[-1]["content"]
    finally:
        conversation.db.close()


def test_unreadable_files_are_named_and_the_conversation_keeps_the_rest(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "note.md").write_text(NOTE, encoding="utf-8")
    (folder / "blob.txt").write_bytes(b"\x00\x01\x02binary" * 100)
    conversation = Conversation(Database(tmp_path / "chat.db"), None, max_context=8192)
    try:
        report = conversation.add(str(folder))
        assert report["added"] == 1
        assert len(report["problems"]) == 1 and "blob.txt" in report["problems"][0]
        assert [d["name"] for d in conversation.documents()] == ["note.md"]
        missing = conversation.add(str(tmp_path / "missing.md"))
        assert missing["added"] == 0 and "missing.md" in missing["problems"][0]
    finally:
        conversation.db.close()


def bytes_read_by_this_process() -> int:
    """What this process has read through read() so far (Linux /proc: cached reads included)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="counts the bytes read in /proc/self/io")
def test_a_document_that_grew_past_the_limit_is_refused_before_it_is_read_again(tmp_path):
    """Issue 64: a /file document that later grew to 40 GB was hashed whole (197 s) before it was refused."""
    from app.documents import MAX_FILE_BYTES

    note = tmp_path / "note.md"
    note.write_text(NOTE, encoding="utf-8")
    conversation = Conversation(Database(tmp_path / "chat.db"), None, max_context=8192)
    try:
        assert conversation.add(str(note))["added"] == 1
        with open(note, "r+b") as f:
            f.truncate(4 * MAX_FILE_BYTES)  # sparse: the disk holds none of it, a read returns every byte
        before = bytes_read_by_this_process()
        report = conversation.add(str(note))
        read = bytes_read_by_this_process() - before
        assert report["added"] == 0
        assert report["problems"] == ["note.md is 200.0 MB, over the 50.0 MB limit for documents"]
        assert read <= MAX_FILE_BYTES + 1, f"{read} bytes read to refuse it"
        # what was read before stays in the conversation
        assert [d["name"] for d in conversation.documents()] == ["note.md"]
    finally:
        conversation.db.close()


def test_a_file_that_grows_while_it_is_read_is_read_no_further_than_the_limit(tmp_path):
    from app.documents import DocumentError, read_at_most

    grown = tmp_path / "grown.txt"
    with open(grown, "wb") as f:
        f.truncate(4096 + 1000)
    with pytest.raises(DocumentError, match="grown.txt is over the 4.0 KB limit for documents"):
        read_at_most(grown, 4096)
    grown.write_bytes(b"x" * 4096)
    assert read_at_most(grown, 4096) == b"x" * 4096


def test_a_conversation_is_kept_once_something_was_asked_or_added(tmp_path):
    db = Database(tmp_path / "chat.db")
    try:
        conversation = Conversation(db, None, max_context=8192)
        conversation.leave()
        assert db.conversations() == []  # nothing asked, nothing added: not kept
        conversation = Conversation(db, None, max_context=8192)
        conversation.ask("What is the capital of France?")
        conversation.answered("Paris.", [])
        conversation.leave()
        kept = db.conversations()
        assert [(c["title"], c["is_open"]) for c in kept] == [("What is the capital of France?", 0)]  # not a tab
        assert [m["content"] for m in db.messages(kept[0]["id"])] == ["What is the capital of France?", "Paris."]
        note = tmp_path / "note.md"
        note.write_text(NOTE, encoding="utf-8")
        conversation = Conversation(db, None, max_context=8192)
        conversation.add(str(note))
        conversation.leave()
        assert len(db.conversations()) == 2  # a document but no question yet: kept
        conversation = Conversation(db, None, max_context=8192)
        db.delete_conversation(conversation.id)  # by the window, while the terminal is in it
        conversation.leave()
        assert len(db.conversations()) == 2
    finally:
        db.close()


def test_open_goes_on_with_a_kept_conversation(tmp_path, capsys):
    db = Database(tmp_path / "chat.db")
    try:
        conversation = Conversation(db, None, max_context=8192)
        first = conversation.id
        conversation.ask("What is the capital of France?")
        conversation.answered("Paris.", [])
        conversation.new()
        second = conversation.id
        assert conversation.open(first)["id"] == first
        assert second not in [c["id"] for c in db.conversations()]  # left empty: gone
        messages, _, _ = conversation.ask("And of Spain?")
        assert [m["content"] for m in messages[1:]] == ["What is the capital of France?", "Paris.", "And of Spain?"]
        with pytest.raises(KeyError):
            conversation.open(second)
        assert conversation.id == first
        for typed in ("²", "9" * 30, "-1", "one"):  # what /open refuses before it reaches the database
            _open(conversation, typed)
        assert "/open needs the number /history shows" in capsys.readouterr().err
        assert conversation.id == first
    finally:
        db.close()


def test_a_question_that_cannot_be_saved_is_not_in_the_conversation(tmp_path):
    db = Database(tmp_path / "chat.db", timeout=0.2)
    other = sqlite3.connect(tmp_path / "chat.db", isolation_level=None)
    try:
        conversation = Conversation(db, None, max_context=8192)
        other.execute("BEGIN IMMEDIATE")  # another process writing, past the timeout
        with pytest.raises(DatabaseLocked):
            conversation.ask("What is the capital of France?")
        other.execute("ROLLBACK")
        assert db.messages(conversation.id) == []
        messages, _, _ = conversation.ask("What is the capital of France?")
        assert messages[-1]["content"] == "What is the capital of France?"
    finally:
        other.close()
        db.close()


def chat(args, lines, home, timeout=300):
    """`kvboost chat` as a user runs it, typing `lines`, with `home` as the app's home folder."""
    return subprocess.run([sys.executable, "-m", "cli.kvboost", "chat", "--max-new-tokens", "24", "--threads", "2",
                           "--disk-cache-bytes", "0", *args], input="\n".join(lines) + "\n", capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT,
                          env=dict(os.environ, PYTHONUNBUFFERED="1", KVBOOST_HOME=str(home)))


@pytest.mark.slow
def test_conversations_are_kept_and_go_on_in_a_later_chat(tmp_path):
    first = chat([], ["What is the capital of France?", "/quit"], tmp_path)
    assert first.returncode == 0, first.stderr
    assert "Conversations are kept in" in first.stderr
    with Database(tmp_path / "data" / "kvboost.sqlite3") as db:
        [kept] = db.conversations()
        assert kept["title"] == "What is the capital of France?"
        assert [m["role"] for m in db.messages(kept["id"])] == ["user", "assistant"]
        answer = db.messages(kept["id"])[1]["content"]
        assert "Paris" in answer
    second = chat([], ["/history", f"/open {kept['id']}", "And what language do people speak there?", "/open 999",
                       "/quit"], tmp_path)
    assert second.returncode == 0, second.stderr
    assert f"  {kept['id']:>4}  What is the capital of France?  (2 messages," in second.stdout
    assert f"[conversation {kept['id']}: What is the capital of France?, 2 messages, 0 documents]" in second.stdout
    assert "error: there is no conversation 999" in second.stderr
    with Database(tmp_path / "data" / "kvboost.sqlite3") as db:
        assert [c["id"] for c in db.conversations()] == [kept["id"]]  # the second chat's own, empty: not kept
        assert [m["content"] for m in db.messages(kept["id"])][:3] == [
            "What is the capital of France?", answer, "And what language do people speak there?"]
        assert len(db.messages(kept["id"])) == 4
    third = chat(["--temporary"], ["What is the capital of Spain?", "/quit"], tmp_path)
    assert third.returncode == 0, third.stderr
    assert "kept in" not in third.stderr
    with Database(tmp_path / "data" / "kvboost.sqlite3") as db:
        assert len(db.conversations()) == 1 and len(db.messages(kept["id"])) == 4
    assert "Traceback" not in first.stderr + second.stderr + third.stderr


@pytest.mark.slow
def test_a_chat_whose_database_is_locked_answers_and_says_it_is_not_kept(tmp_path):
    (tmp_path / "data").mkdir()
    Database(tmp_path / "data" / "kvboost.sqlite3").close()  # the app's database, as the window made it
    other = sqlite3.connect(tmp_path / "data" / "kvboost.sqlite3", isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")  # the window (or another chat) writing for longer than the busy timeout
        proc = chat([], ["What is the capital of France?", "/history", "/quit"], tmp_path)
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert proc.returncode == 0, proc.stderr
    assert "warning: this chat is not kept:" in proc.stderr and "locked" in proc.stderr
    assert "Paris" in proc.stdout
    assert "  What is the capital of France?  (2 messages," in proc.stdout  # kept for the chat's run
    assert "Traceback" not in proc.stderr
    with Database(tmp_path / "data" / "kvboost.sqlite3") as db:
        assert db.conversations() == []


@pytest.mark.slow
def test_chat_with_a_document_as_a_user_types_it(tmp_path):
    note = tmp_path / "note.md"
    note.write_text(NOTE, encoding="utf-8")
    lines = ["/help", "/files", f"/file {note}", f"/file {tmp_path / 'missing.md'}", "/files",
             "When does the ferry leave?", "/frobnicate", "/reset", "/files", "/quit"]
    proc = chat([], lines, tmp_path / "home")
    assert proc.returncode == 0, proc.stderr
    assert "/file PATH" in proc.stdout  # /help lists the commands
    assert proc.stdout.count("[no documents: /file PATH adds one]") == 2  # before /file and after /reset
    assert "  note.md (" in proc.stdout
    assert "error: missing.md: not found" in proc.stderr
    assert "unknown command /frobnicate" in proc.stderr
    assert "7:40" in proc.stdout  # the answer comes from the note
    assert "[from: note.md, Harbour note]" in proc.stderr
    # /file read the note into the cache: the question's prompt is mostly reused, only the question computed
    reused = [int(m) for m in re.findall(r"(\d+)% reused", proc.stderr)]
    assert len(reused) == 1 and reused[0] >= 60
    assert "Traceback" not in proc.stderr


def test_warm_reads_files_as_the_app_does_and_names_the_ones_it_cannot(tmp_path):
    """`kvboost warm` over a tiny model: a .docx's text is warmed (not its zip bytes), a binary file and a
    missing one are named with the reason, and the exit code says that some failed."""
    import docx
    from gguf_files import tiny_gguf

    model = tiny_gguf(tmp_path / "tiny.gguf", "Q8_0")
    document = docx.Document()
    document.add_paragraph("The ferry leaves at 7:40 from pier 3.")
    document.save(tmp_path / "ferry.docx")
    (tmp_path / "blob.txt").write_bytes(b"\x00\x01\x02binary" * 100)
    proc = subprocess.run([sys.executable, "-m", "cli.kvboost", "warm", "--model", str(model), "--disk-cache-bytes",
                           "0", str(tmp_path / "ferry.docx"), str(tmp_path / "blob.txt"), str(tmp_path / "gone.md")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 1, proc.stderr
    warmed = re.search(r"ferry\.docx: (\d+) tokens", proc.stdout)
    assert warmed and 0 < int(warmed[1]) < 40  # the sentence, not the ~36 KB of the file's zip
    assert "kvboost warm: blob.txt" in proc.stderr and "kvboost warm: gone.md" in proc.stderr
    assert "Traceback" not in proc.stderr
