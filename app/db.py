"""The app's one SQLite file: conversations, messages, documents and their passages, settings.

Built on sqlite-utils (4.x semantics: a write outside `atomic()` is committed at once); the documents half is
app.db_documents. No Qt here, so the storage rules are testable on their own. Every public method returns
plain dicts with the JSON columns (`sampling`, `stats`, `sources`) already decoded.

Durability: WAL journal + synchronous=NORMAL + one commit per public write means a killed or crashed app
loses nothing it had already written; only a power cut can drop the last few commits, never corrupt the
file. Multi-row changes (a document's passages, an import, migrations) are single transactions.

Other processes (a second app, the server, a script) may use the same file: every write waits for theirs
and a write that cannot be made raises DatabaseError naming the file (app.db_connection).
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from sqlite_utils.db import NotFoundError

from .db_connection import DEFAULT_BUSY_TIMEOUT, Connection, DatabaseError, DatabaseLocked, file_identity, write_error
from .db_documents import DocumentTables
from .db_schema import MIGRATIONS
from .db_values import (  # noqa: F401
    DEFAULT_SAMPLING,
    DEFAULT_TITLE,
    ROLES,
    STATUSES,
    check_role,
    check_status,
    decoded,
    encode_json,
    fts_string,
    merged_sampling,
    title_from_question,
)

__all__ = ["Database", "DatabaseError", "DatabaseLocked", "DEFAULT_BUSY_TIMEOUT"]

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
_UPDATABLE_CONVERSATION_FIELDS = ("title", "system_prompt", "sampling", "is_open", "tab_order")

MATCH_START, MATCH_END = "\x02", "\x03"  # around each match in a search snippet (search_messages)


class Database(DocumentTables):
    """The app's SQLite file.

    Open it on the UI thread and use it only there: the connection keeps sqlite3's same-thread check, and
    the class holds no locks. Each call is a few milliseconds at most, so the UI never needs to wait on a
    worker for it.
    """

    def __init__(
        self, path: str | Path, *, clock: Callable[[], float] = time.time, timeout: float = DEFAULT_BUSY_TIMEOUT
    ):
        """`timeout`: seconds a write waits for another process to release the write lock before
        DatabaseLocked."""
        self.path = Path(path)
        self._clock = clock  # unix seconds; injectable so tests can order rows deterministically
        try:
            conn = sqlite3.connect(self.path, timeout=timeout)
        except sqlite3.Error as exc:
            raise DatabaseError(f"cannot open database {self.path}: {exc}") from exc
        try:
            self._db = Connection(conn, self.path, timeout)
            self._open_and_migrate()
            self._db.identity = file_identity(self.path)
        except sqlite3.DatabaseError as exc:
            conn.close()
            error = write_error(self.path, exc)
            if error is not exc:
                raise error from exc
            raise DatabaseError(f"{self.path} is not a usable KVBoost database: {exc}") from exc
        except BaseException:
            conn.close()
            raise

    def _open_and_migrate(self) -> None:
        found = self._stored_schema_version()
        latest = len(MIGRATIONS)
        if found > latest:
            # Checked before any pragma that writes to the file, so a newer app's data stays untouched.
            raise DatabaseError(
                f"{self.path} has schema version {found}, but this version of the app understands only up "
                f"to {latest}; update KVBoost Desktop or use another data folder"
            )
        self._db.execute("PRAGMA foreign_keys = ON")
        self._db.enable_wal()
        self._db.execute("PRAGMA synchronous = NORMAL")
        if found < latest:
            with self._db.atomic():
                found = self._stored_schema_version()  # again, under the write lock: another process may have
                for migrate in MIGRATIONS[found:]:  # migrated it while this one waited
                    migrate(self._db)
                self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('schema_version', ?)", [str(latest)])

    def _stored_schema_version(self) -> int:
        """0 for an empty file; refuses a SQLite file that holds someone else's tables."""
        table_names = self._db.table_names()  # the first read: raises on a file that is not SQLite
        if "meta" not in table_names:
            if table_names:
                raise DatabaseError(
                    f"{self.path} is a SQLite file but not a KVBoost database (it has tables {table_names})"
                )
            return 0
        row = self._db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        try:
            return int(row[0]) if row else 0
        except ValueError:
            raise DatabaseError(f"{self.path} has an unreadable schema_version {row[0]!r}") from None

    @property
    def schema_version(self) -> int:
        return self._stored_schema_version()

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Database:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- conversations ------------------------------------------------------------------------------------

    def create_conversation(
        self, title: str = DEFAULT_TITLE, system_prompt: str | None = None, sampling: dict | None = None
    ) -> dict:
        """A new open tab at the end of the tab strip. `sampling` keys override DEFAULT_SAMPLING."""
        now = self._clock()
        row = {
            "title": title,
            "system_prompt": DEFAULT_SYSTEM_PROMPT if system_prompt is None else system_prompt,
            "sampling": encode_json(merged_sampling(DEFAULT_SAMPLING, sampling)),
            "created_at": now,
            "updated_at": now,
            "is_open": 1,
        }
        with self._db.atomic():
            table = self._db["conversations"].insert({**row, "tab_order": self._next_tab_order()})
        return self.conversation(table.last_pk)

    def conversation(self, cid: int) -> dict:
        try:
            return decoded(self._db["conversations"].get(cid))
        except NotFoundError:
            raise KeyError(f"no conversation with id {cid}") from None

    def conversations(self, open_only: bool = False) -> list[dict]:
        """Open tabs in tab order, or every conversation, most recently updated first."""
        if open_only:
            sql = "SELECT * FROM conversations WHERE is_open = 1 ORDER BY tab_order, id"
        else:
            sql = "SELECT * FROM conversations ORDER BY updated_at DESC, id DESC"
        return [decoded(row) for row in self._db.query(sql)]

    def update_conversation(self, cid: int, **fields: Any) -> dict:
        """Change title/system_prompt/sampling/is_open/tab_order and bump updated_at; returns the new row.

        `sampling` is merged over the current values. Reopening a closed conversation without a
        `tab_order` puts its tab at the end.
        """
        unknown = sorted(set(fields) - set(_UPDATABLE_CONVERSATION_FIELDS))
        if unknown:
            raise ValueError(f"cannot update conversation fields {unknown}; allowed: {_UPDATABLE_CONVERSATION_FIELDS}")
        with self._db.atomic():  # the merge reads the row it rewrites: no other writer in between
            current = self.conversation(cid)
            updates = dict(fields)
            if "sampling" in updates:
                updates["sampling"] = encode_json(merged_sampling(current["sampling"], updates["sampling"]))
            if "is_open" in updates:
                updates["is_open"] = int(bool(updates["is_open"]))
                if updates["is_open"] and not current["is_open"] and "tab_order" not in updates:
                    updates["tab_order"] = self._next_tab_order()
            updates["updated_at"] = self._clock()
            self._db["conversations"].update(cid, updates)
        return self.conversation(cid)

    def title_if_untitled(self, cid: int, question: str) -> str | None:
        """A conversation still called DEFAULT_TITLE takes `question`'s opening words; returns the new title, or
        None where the conversation has a name (a rename sticks)."""
        if self.conversation(cid)["title"] != DEFAULT_TITLE:  # most questions: no write lock taken
            return None
        with self._db.atomic():
            if self.conversation(cid)["title"] != DEFAULT_TITLE:  # renamed by another process meanwhile
                return None
            title = title_from_question(question)
            self._db["conversations"].update(cid, {"title": title, "updated_at": self._clock()})
        return title

    def set_tab_order(self, cids: Iterable[int]) -> None:
        """tab_order = index in `cids`, all or nothing."""
        with self._db.atomic():
            for index, cid in enumerate(cids):
                cursor = self._db.execute("UPDATE conversations SET tab_order = ? WHERE id = ?", [index, cid])
                if cursor.rowcount == 0:
                    raise KeyError(f"no conversation with id {cid}")

    def delete_conversation(self, cid: int) -> None:
        """Deletes its messages and document attachments too (the documents themselves stay)."""
        try:
            with self._db.atomic():
                self._db["conversations"].delete(cid)
        except NotFoundError:
            raise KeyError(f"no conversation with id {cid}") from None

    def _next_tab_order(self) -> int:
        return self._db.execute("SELECT COALESCE(MAX(tab_order), -1) + 1 FROM conversations").fetchone()[0]

    # -- messages -----------------------------------------------------------------------------------------

    def add_message(
        self,
        cid: int,
        role: str,
        content: str,
        *,
        status: str = "done",
        stats: dict | None = None,
        sources: list | None = None,
    ) -> dict:
        """Append a message (position = last + 1) and bump the conversation's updated_at."""
        check_role(role)
        check_status(status)
        if not isinstance(content, str):
            raise ValueError(f"message content must be a str, got {type(content).__name__}")
        now = self._clock()
        with self._db.atomic():
            self.conversation(cid)
            position = self._db.execute(
                "SELECT COALESCE(MAX(position), -1) + 1 FROM messages WHERE conversation_id = ?", [cid]
            ).fetchone()[0]
            table = self._db["messages"].insert(
                {
                    "conversation_id": cid,
                    "position": position,
                    "role": role,
                    "content": content,
                    "status": status,
                    "stats": None if stats is None else encode_json(stats),
                    "sources": None if sources is None else encode_json(sources),
                    "created_at": now,
                }
            )
            self._db.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", [now, cid])
        return self.message(table.last_pk)

    def update_message(
        self,
        mid: int,
        *,
        content: str | None = None,
        status: str | None = None,
        stats: dict | None = None,
        sources: list | None = None,
        prompt: str | None = None,
    ) -> dict:
        """Change the given fields (None = leave as is); committed before returning the new row.

        `prompt` is the text actually sent to the model for a user turn when it differs from what the user
        typed (document passages added); replaying it verbatim later keeps the engine's KV reuse exact.
        """
        updates: dict[str, Any] = {}
        for name, text in (("content", content), ("prompt", prompt)):
            if text is not None:
                if not isinstance(text, str):
                    raise ValueError(f"message {name} must be a str, got {type(text).__name__}")
                updates[name] = text
        if status is not None:
            check_status(status)
            updates["status"] = status
        if stats is not None:
            updates["stats"] = encode_json(stats)
        if sources is not None:
            updates["sources"] = encode_json(sources)
        try:
            with self._db.atomic():
                self._db["messages"].update(mid, updates)
        except NotFoundError:
            raise KeyError(f"no message with id {mid}") from None
        return self.message(mid)

    def message(self, mid: int) -> dict:
        try:
            return decoded(self._db["messages"].get(mid))
        except NotFoundError:
            raise KeyError(f"no message with id {mid}") from None

    def messages(self, cid: int) -> list[dict]:
        rows = self._db.query("SELECT * FROM messages WHERE conversation_id = ? ORDER BY position", [cid])
        return [decoded(row) for row in rows]

    def delete_messages_from(self, cid: int, position: int) -> int:
        """Delete the messages at `position` and after (regenerate, edit-and-resend); returns how many."""
        with self._db.atomic():
            cursor = self._db.execute("DELETE FROM messages WHERE conversation_id = ? AND position >= ?",
                                      [cid, position])
        return cursor.rowcount

    def mark_interrupted(self) -> int:
        """Run at start-up: answers still "streaming" belong to a process that died; returns how many."""
        with self._db.atomic():
            return self._db.execute("UPDATE messages SET status = 'interrupted' WHERE status = 'streaming'").rowcount

    def search_messages(self, query: str, limit: int = 50) -> list[dict]:
        """Messages containing every word of `query`, best bm25 first, with a snippet whose matches are between
        MATCH_START and MATCH_END (control characters no message shows; the sidebar makes them bold).

        Any user text is safe: words are passed as quoted FTS5 strings, so operators and punctuation
        are searched for literally (foo-bar is the phrase "foo bar").
        """
        words = [word for word in query.split() if any(ch.isalnum() for ch in word)]
        if not words:
            return []
        rows = self._db.query(
            """
            SELECT m.conversation_id, c.title, m.id AS message_id, m.position, m.role,
                   snippet(messages_fts, 0, char(2), char(3), '…', 12) AS snippet
            FROM messages_fts
            JOIN messages AS m ON m.id = messages_fts.rowid
            JOIN conversations AS c ON c.id = m.conversation_id
            WHERE messages_fts MATCH ?
            ORDER BY bm25(messages_fts), m.id
            LIMIT ?
            """,
            [" AND ".join(fts_string(word) for word in words), limit],
        )
        return list(rows)

    # -- settings -----------------------------------------------------------------------------------------

    def get_setting(self, key: str, default: Any = None) -> Any:
        row = self._db.execute("SELECT value FROM settings WHERE key = ?", [key]).fetchone()
        return default if row is None else json.loads(row[0])

    def set_setting(self, key: str, value: Any) -> None:
        row = {"key": key, "value": encode_json(value)}
        with self._db.atomic():
            self._db["settings"].upsert(row, pk="key")

    def set_settings(self, rows: dict[str, Any]) -> None:
        """Several settings in one transaction: all of them stored, or none."""
        encoded = [{"key": key, "value": encode_json(value)} for key, value in rows.items()]
        with self._db.atomic():
            self._db["settings"].upsert_all(encoded, pk="key")

    # -- import (the format lives in app.conversation_export) --------------------------------------------

    def now(self) -> float:
        """The database's clock (unix seconds): what it stamps rows with."""
        return self._clock()

    def add_conversation_with_messages(self, conversation: dict, messages: list[dict]) -> dict:
        """A new open conversation from validated rows, in one transaction."""
        with self._db.atomic():
            cid = self._db["conversations"].insert({**conversation, "tab_order": self._next_tab_order()}).last_pk
            self._db["messages"].insert_all(
                {"conversation_id": cid, "position": position, "status": "done", **message}
                for position, message in enumerate(messages)
            )
        return self.conversation(cid)
