"""A conversation tab whose database cannot be written (another process holds it locked past the timeout): the
message is not lost (it stays in the composer), the failure reaches the error banner, nothing raises."""

from __future__ import annotations

import subprocess
import sys

import pytest
from qt_helpers import result_of


def hold_lock(path, seconds: float) -> subprocess.Popen:
    code = ("import sqlite3, sys, time\n"
            "db = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
            "db.execute('BEGIN EXCLUSIVE')\n"
            "print('locked', flush=True)\n"
            "time.sleep(float(sys.argv[2]))\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(path), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


@pytest.mark.timeout(120)
def test_a_message_that_cannot_be_saved_stays_in_the_composer_and_is_reported(qtbot, loaded_client, tmp_path):
    from app.conversation_tab import ConversationTab
    from app.db import Database

    db = Database(tmp_path / "kvboost.sqlite3", timeout=0.3)
    tab = ConversationTab(db.create_conversation(), db, loaded_client, "light")
    qtbot.addWidget(tab)
    errors = []
    tab.error_raised.connect(errors.append)
    tab.composer.setPlainText("What is the capital of France?")
    holder = hold_lock(tmp_path / "kvboost.sqlite3", 30)
    try:
        tab.send()  # raised sqlite3/DatabaseError out of the slot before
    finally:
        holder.kill()
        holder.wait()
    assert tab.composer.toPlainText() == "What is the capital of France?"
    assert len(errors) == 1 and "not sent" in errors[0] and "kvboost.sqlite3" in errors[0]
    assert db.messages(tab.conversation_id) == [] and not tab.is_generating
    # with the lock gone the same message goes through
    tab.send()
    result_of(qtbot, tab.request, timeout=60_000)
    assert [m["role"] for m in db.messages(tab.conversation_id)] == ["user", "assistant"]
    db.close()
