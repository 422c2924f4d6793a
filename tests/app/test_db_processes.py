"""app.db with other processes on the same real SQLite file: writers that interleave lose nothing, and a new
file opened by several processes at once is migrated once."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from app.db import Database

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "kvboost.sqlite3"


# -- several processes on one file -------------------------------------------------------------------------

# A second writer (another app instance, the server, a script): adds `count` messages to conversation 1,
# alternating with the others as fast as it can, and prints how many calls raised.
WRITER = textwrap.dedent(
    """
    import sys
    from app.db import Database
    path, tag, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    failed = 0
    with Database(path) as db:
        for i in range(count):
            try:
                db.add_message(1, "user", f"{tag} {i}")
            except Exception as exc:
                failed += 1
                print(type(exc).__name__, exc, file=sys.stderr)
    print(failed)
    """
)


def test_two_processes_adding_messages_at_once_lose_nothing(db_path: Path):
    with Database(db_path) as db:
        cid = db.create_conversation("Shared")["id"]
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(db_path), tag, "300"], cwd=REPO_ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for tag in ("a", "b")
    ]
    results = [writer.communicate(timeout=120) for writer in writers]
    assert [(writer.returncode, out.strip()) for writer, (out, _) in zip(writers, results)] == [(0, "0"), (0, "0")], (
        results[0][1][-500:] + results[1][1][-500:]
    )
    with Database(db_path) as db:
        messages = db.messages(cid)
    assert len(messages) == 600
    assert [m["position"] for m in messages] == list(range(600))
    for tag in ("a", "b"):  # each writer's messages are all there, in the order it wrote them
        assert [m["content"] for m in messages if m["content"].startswith(tag)] == [f"{tag} {i}" for i in range(300)]


def test_processes_opening_a_new_file_at_once_migrate_it_once(db_path: Path):
    script = "import sys\nfrom app.db import Database\nwith Database(sys.argv[1]) as db: print(db.schema_version)"
    openers = [subprocess.Popen([sys.executable, "-c", script, str(db_path)], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for _ in range(4)]
    results = [opener.communicate(timeout=60) for opener in openers]
    assert [(opener.returncode, out.strip()) for opener, (out, _) in zip(openers, results)] == [(0, "1")] * 4, (
        [err[-300:] for _, err in results]
    )
