"""The conversation database under faults, injected the way they really happen: another process holding the
lock, a full disk, the folder deleted under a running app, the app killed mid-write.

Each test asserts "nothing lost": every write that returned is there afterwards, a write that failed raised
a DatabaseError naming the file and left nothing of itself behind, and the file passes integrity_check.
"""

from __future__ import annotations

import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from app.db import Database, DatabaseError, DatabaseLocked

ROOT = Path(__file__).resolve().parents[2]

# Holds the write lock (BEGIN EXCLUSIVE) on a database for argv[2] seconds, then commits and exits.
HOLD_LOCK = textwrap.dedent("""
    import sqlite3, sys, time
    conn = sqlite3.connect(sys.argv[1], isolation_level=None)
    conn.execute("BEGIN EXCLUSIVE")
    print("locked", flush=True)
    time.sleep(float(sys.argv[2]))
    conn.execute("COMMIT")
""")


def integrity(path: Path) -> str:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        conn.close()


def contents(path: Path) -> dict[int, str]:
    """Message id -> content, read by a fresh connection."""
    with Database(path) as db:
        return {m["id"]: m["content"] for c in db.conversations() for m in db.messages(c["id"])}


@pytest.fixture
def db_with_messages(tmp_path: Path):
    """A database file with one conversation of three messages; yields (path, conversation id, message ids)."""
    path = tmp_path / "data" / "kvboost.sqlite3"
    path.parent.mkdir()
    with Database(path) as db:
        cid = db.create_conversation("Kept")["id"]
        mids = [db.add_message(cid, "user", f"message {i}")["id"] for i in range(3)]
    return path, cid, mids


@pytest.fixture
def db_lock_holder():
    """hold(path, seconds): another real process holding the database's write lock; returns once it has it."""
    holders = []

    def hold(path: Path, seconds: float) -> subprocess.Popen:
        holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(path), str(seconds)],
                                  stdout=subprocess.PIPE, text=True)
        holders.append(holder)
        assert holder.stdout.readline().strip() == "locked"
        return holder

    yield hold
    for holder in holders:
        holder.kill()
        holder.wait()


# -- locked by another process ---------------------------------------------------------------------------


def test_a_write_waits_for_another_process_holding_the_lock_then_succeeds(db_with_messages, db_lock_holder):
    path, cid, mids = db_with_messages
    with Database(path, timeout=20) as db:
        holder = db_lock_holder(path, 1.5)
        start = time.monotonic()
        message = db.add_message(cid, "assistant", "written after the lock was released")
        waited = time.monotonic() - start
        renamed = db.update_conversation(cid, title="Still kept")
    assert holder.wait(timeout=10) == 0
    assert 1.0 < waited < 15
    assert renamed["title"] == "Still kept"
    assert contents(path) == {**{mid: f"message {i}" for i, mid in enumerate(mids)},
                              message["id"]: "written after the lock was released"}
    assert integrity(path) == "ok"


@pytest.mark.parametrize("write", ["add_message", "update_message", "update_conversation", "set_setting",
                                   "delete_messages_from"])
def test_a_lock_held_past_the_timeout_is_a_clear_error_and_writes_nothing(db_with_messages, db_lock_holder, write):
    path, cid, mids = db_with_messages
    calls = {
        "add_message": lambda db: db.add_message(cid, "user", "never stored"),
        "update_message": lambda db: db.update_message(mids[0], content="never stored"),
        "update_conversation": lambda db: db.update_conversation(cid, title="never stored"),
        "set_setting": lambda db: db.set_setting("theme", "never stored"),
        "delete_messages_from": lambda db: db.delete_messages_from(cid, 0),
    }
    with Database(path, timeout=0.5) as db:
        before = (db.conversation(cid), db.messages(cid), db.get_setting("theme"))
        holder = db_lock_holder(path, 60)
        start = time.monotonic()
        with pytest.raises(DatabaseLocked, match="locked by another process") as raised:
            calls[write](db)
        assert 0.4 < time.monotonic() - start < 5
        assert str(path) in str(raised.value)
        holder.kill()
        holder.wait()
        assert (db.conversation(cid), db.messages(cid), db.get_setting("theme")) == before  # nothing half-written
        db.add_message(cid, "user", "the lock is gone")  # the same connection writes again
    assert list(contents(path).values()) == ["message 0", "message 1", "message 2", "the lock is gone"]
    assert integrity(path) == "ok"


# -- disk full ---------------------------------------------------------------------------------------------


@pytest.fixture
def db_small_disk(tmp_path: Path):
    """A 256 KiB tmpfs (needs root and mount; skipped otherwise); yields (folder, grow) where grow() makes it
    1 MiB, as freeing space would."""
    folder = tmp_path / "small-disk"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")

    def grow() -> None:
        subprocess.run(["mount", "-o", "remount,size=1m", str(folder)], check=True)

    yield folder, grow
    subprocess.run(["umount", "-l", str(folder)], check=True)


def fill(db: Database, cid: int) -> list[int]:
    """Adds 4 KB messages until the disk is full; returns the ids of those that were stored."""
    stored = []
    with pytest.raises(DatabaseError, match="full") as raised:
        for _ in range(10_000):
            stored.append(db.add_message(cid, "user", f"{len(stored)} " + "x" * 4000)["id"])
    assert str(db.path) in str(raised.value)
    return stored


def test_a_full_disk_is_a_clear_error_and_loses_nothing_already_written(db_small_disk):
    folder, grow = db_small_disk
    path = folder / "kvboost.sqlite3"
    with Database(path) as db:
        cid = db.create_conversation("Full")["id"]
        stored = fill(db, cid)
        assert stored, "a few messages fit"
        assert [m["id"] for m in db.messages(cid)] == stored  # the failed one left nothing
        grow()
        after = db.add_message(cid, "assistant", "space again")["id"]
    assert list(contents(path)) == [*stored, after]
    assert integrity(path) == "ok"


def test_a_database_at_its_size_limit_is_a_clear_error_and_loses_nothing(tmp_path: Path):
    """SQLite's own "database or disk is full" (PRAGMA max_page_count), where a small disk cannot be mounted."""
    path = tmp_path / "kvboost.sqlite3"
    with Database(path) as db:
        cid = db.create_conversation("Full")["id"]
        pages = db._db.execute("PRAGMA page_count").fetchone()[0]
        db._db.execute(f"PRAGMA max_page_count = {pages + 8}")
        stored = fill(db, cid)
        assert [m["id"] for m in db.messages(cid)] == stored
        db._db.execute("PRAGMA max_page_count = 1000000")
        after = db.add_message(cid, "assistant", "space again")["id"]
    assert list(contents(path)) == [*stored, after]
    assert integrity(path) == "ok"


# -- the folder deleted under a running app ----------------------------------------------------------------


def test_a_write_after_the_data_folder_was_deleted_is_a_clear_error_not_a_silent_loss(db_with_messages):
    path, cid, _ = db_with_messages
    with Database(path) as db:
        shutil.rmtree(path.parent)
        with pytest.raises(DatabaseError, match="moved or deleted") as raised:
            db.add_message(cid, "user", "would vanish with the deleted file")
        assert str(path) in str(raised.value)
        path.parent.mkdir()  # the folder comes back (restored, recreated): still not the file this one opened
        with pytest.raises(DatabaseError, match="moved or deleted"):
            db.set_setting("theme", "dark")
    assert not path.exists()


# -- killed mid-write ----------------------------------------------------------------------------------------

# Writes messages and whole imported conversations as fast as it can, printing each one's id once the call
# returned, until killed.
WRITER = textwrap.dedent("""
    import sys
    from app.db import Database
    db = Database(sys.argv[1])
    cid = db.create_conversation("Killed")["id"]
    for i in range(1_000_000):
        if i % 10 == 9:
            imported = db.add_conversation_with_messages(
                {"title": f"import {i}", "system_prompt": "", "sampling": "{}", "created_at": 0.0,
                 "updated_at": 0.0, "is_open": 1},
                [{"role": "user", "content": f"import {i} line {j}", "created_at": 0.0} for j in range(200)])
            print("conversation", imported["id"], flush=True)
        else:
            mid = db.add_message(cid, "user", f"message {i}")["id"]
            db.update_message(mid, content=f"message {i} edited")
            print("message", mid, i, flush=True)
""")


def test_a_process_killed_while_writing_leaves_every_returned_write_and_an_intact_file(tmp_path: Path):
    path = tmp_path / "kvboost.sqlite3"
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    returned = []
    try:
        while len(returned) < 300:
            line = child.stdout.readline()
            assert line, "the writer stopped early"
            returned.append(line.split())
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        rest, _ = child.communicate(timeout=30)
    returned += [line.split() for line in rest.splitlines() if line.strip()]
    assert integrity(path) == "ok"
    with Database(path) as db:
        stored = {m["id"]: m["content"] for m in db.messages(1)}
        for kind, *fields in returned:
            if kind == "message":
                mid, i = int(fields[0]), int(fields[1])
                assert stored[mid] == f"message {i} edited"
            else:
                assert len(db.messages(int(fields[0]))) == 200
        # A conversation being imported at the kill is all there or not there at all.
        for conversation in db.conversations():
            if conversation["title"].startswith("import"):
                assert len(db.messages(conversation["id"])) == 200
