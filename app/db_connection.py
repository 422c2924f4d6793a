"""How the app's database connection writes when other processes use the same file.

Every write is an immediate transaction: it takes the write lock before its first read, waiting up to the busy
timeout for another writer (and retrying the few "busy" answers SQLite gives without waiting), so concurrent
writers queue instead of failing. A write that cannot be made (locked past the timeout, disk full, read-only,
I/O error, the file deleted under it) raises DatabaseError naming the file, after the rollback. app.db builds
on this; no Qt here.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from pathlib import Path

import sqlite_utils

DEFAULT_BUSY_TIMEOUT = 5.0  # seconds a write waits for another process's write lock
_BEGIN_ATTEMPTS = 5  # SQLite sometimes answers "busy" without waiting; retried while the timeout lasts


class DatabaseError(RuntimeError):
    """The file cannot be used: not SQLite, not ours, written by a newer version of the app, or a write to it
    failed (locked, full, read-only, I/O error); the message names the file."""


class DatabaseLocked(DatabaseError):
    """Another process held the write lock for longer than the busy timeout."""


# SQLite's primary result codes for the failures a write can meet that are not the program's fault.
_BUSY, _LOCKED, _READONLY, _IOERR, _CORRUPT, _FULL, _CANTOPEN = 5, 6, 8, 10, 11, 13, 14
_CODES_BY_MESSAGE = (  # Python < 3.11 gives only the message
    ("locked", _BUSY), ("busy", _BUSY), ("readonly", _READONLY), ("read-only", _READONLY),
    ("disk i/o", _IOERR), ("malformed", _CORRUPT), ("full", _FULL), ("unable to open", _CANTOPEN),
)


def _error_code(exc: sqlite3.Error) -> int | None:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF
    message = str(exc).lower()
    return next((code for words, code in _CODES_BY_MESSAGE if words in message), None)


def write_error(path: Path, exc: sqlite3.Error, waited: float | None = None) -> Exception:
    """The DatabaseError to raise for a failed write, or `exc` itself when it is a bug (bad SQL, a constraint)."""
    code = _error_code(exc)
    if code in (_BUSY, _LOCKED):
        waited_text = f" (waited {waited:.1f} s)" if waited is not None else ""
        return DatabaseLocked(f"database {path} is locked by another process{waited_text}; close the other "
                              "KVBoost Desktop, server or script using it, or use another data folder")
    reasons = {_READONLY: "it is read-only, or was moved or deleted while open", _FULL: "the disk is full",
               _IOERR: f"I/O error ({exc})", _CORRUPT: f"the file is damaged ({exc})", _CANTOPEN: f"{exc}"}
    if code in reasons:
        return DatabaseError(f"cannot write to database {path}: {reasons[code]}")
    return exc


def file_identity(path: Path) -> tuple[int, int] | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


class Connection(sqlite_utils.Database):
    """sqlite-utils whose outermost `atomic()` is an immediate transaction.

    A deferred transaction that reads and then writes cannot wait for another process's write (SQLite
    answers "database is locked" at once, since waiting could deadlock); taking the write lock first can.
    Failures come out as DatabaseError (see _write_error), after the rollback.
    """

    def __init__(self, conn: sqlite3.Connection, path: Path, timeout: float):
        super().__init__(conn, execute_plugins=False)
        self.path = path
        self.timeout = timeout
        self.identity: tuple[int, int] | None = None  # (device, inode) of the file once opened

    @contextlib.contextmanager
    def atomic(self):
        if self.conn.in_transaction:
            with super().atomic():  # a savepoint inside the outer transaction
                yield self
            return
        self._begin_immediate()
        try:
            self._check_still_there()
            yield self
            self.conn.execute("COMMIT")
        except BaseException as exc:
            self.rollback()
            if isinstance(exc, sqlite3.OperationalError):
                raise write_error(self.path, exc) from exc
            raise

    def _check_still_there(self) -> None:
        """In WAL mode SQLite goes on writing to a file deleted or replaced under it, so those writes would
        vanish with it: refuse them instead."""
        if self.identity is not None and file_identity(self.path) != self.identity:
            raise DatabaseError(f"cannot write to database {self.path}: it was moved or deleted while open; "
                                "restart the app to use the file now at that path")

    def _begin_immediate(self) -> None:
        start = time.monotonic()
        for attempt in range(1, _BEGIN_ATTEMPTS + 1):
            try:
                self.conn.execute("BEGIN IMMEDIATE")  # waits up to the connection's busy timeout
                return
            except sqlite3.OperationalError as exc:
                waited = time.monotonic() - start
                if _error_code(exc) not in (_BUSY, _LOCKED) or waited >= self.timeout or attempt == _BEGIN_ATTEMPTS:
                    raise write_error(self.path, exc, waited) from exc
                time.sleep(0.02 * attempt)
