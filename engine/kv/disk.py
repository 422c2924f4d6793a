"""The persistent disk tier: one payload file per entry, an index in SQLite, shared by processes.

(One subject, kept whole at ~530 lines: reading, writing and evicting share one lock, one index connection and
one failure policy. Row checks live in engine.kv.disk_rows, maintenance in engine.kv.disk_maintenance.)

Folder layout (default: platformdirs' per-user cache folder, see default_cache_dir):

    index.sqlite3          entries (bookkeeping, one row per payload file), WAL mode
    payloads/<ab>/<key>-<nonce>.kv
    tmp/                   files being written

A payload file (engine.kv.payload_file) holds one entry's tensors and a checksum over all of it.

Safety, in the order things happen:
- Writes are atomic: the file is written under tmp/, fsynced, renamed into payloads/ (a unique name per write,
  so two processes writing the same key never clobber each other's file), the folder fsynced, and only then
  the row is committed. A crash leaves at most an orphan file (`verify` removes it), never a row without data.
- Every read checks the size, the namespace and key in the header and the checksum (header and data), and that
  the file is the KV of what the row says (kind, parent, position, token ids: carried in the header, under the
  checksum). Anything wrong (a truncated, corrupt or missing file, a row another process evicted, a row or file
  edited by hand) is reported as None: a MISS. The caller drops the entry and computes the text again, which
  writes a good file.
- Rows are data from a file anyone may edit: each one is checked before use (types, lengths, its key recomputed
  from its parent and tokens, its file name of the pattern the tier itself writes). A bad row is dropped without
  touching the path it names (engine.kv.disk_rows); files are only ever opened or removed under payloads/ and tmp/,
  regular files only,
  never through a symbolic link.
- Rows carry the namespace of the engine that wrote them (model fingerprint, chunking, kv_quant, format
  version); a store only ever loads rows of its own namespace.
- The byte budget is enforced inside one write transaction (BEGIN IMMEDIATE), so two processes sharing the
  folder never overshoot it together. Files of evicted rows are unlinked after the commit; a reader that had
  the file open keeps reading it (POSIX), one that had not gets a MISS.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import secrets
import shutil
import sqlite3
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import sqlite_utils

from . import disk_maintenance
from .disk_maintenance import CACHE_DIR_ENV_VAR, INDEX_FILENAME, default_cache_dir  # noqa: F401 (public here)
from .disk_rows import _HEX_KEY, entry_fields, is_payload_name, parse_row, payload_name
from .eviction import LRU, Candidate, rank
from .payload_file import PayloadError, decode_file, encode_file
from .tiers import QUANT_MODES, StoredKV

log = logging.getLogger(__name__)



def default_disk_budget(folder: Path) -> int:
    """A fifth of the free space where the folder lives, at most 20 GiB."""
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        free = 10 << 30
    return min(free // 5, 20 << 30)


# -- the index ------------------------------------------------------------------------------------------------
def _degrades(default):
    """A runtime failure of the folder or the index (disk full, I/O error, a lock held past the timeout) must
    not take the engine down: the method logs it, counts it and answers `default` (a MISS, nothing stored)."""

    def wrap(method):
        @functools.wraps(method)
        def inner(self, *args, **kwargs):
            try:
                return method(self, *args, **kwargs)
            except (sqlite3.Error, OSError) as exc:
                self._failed(method.__name__, exc)
                return default(self) if callable(default) else default

        return inner

    return wrap


@dataclass
class DiskCounters:
    writes: int = 0
    reads: int = 0
    read_bytes: int = 0
    read_ms: float = 0.0
    bad: int = 0  # missing / truncated / corrupt files found on read (served as MISS)
    errors: int = 0  # index or folder failures (disk full, I/O errors): the operation did nothing
    evicted: int = 0
    rejected: int = 0


class DiskTier:
    """Payload files + SQLite index in `folder`. `namespace` None opens it for maintenance only
    (stats / clear / verify across namespaces)."""

    name = "disk"

    def __init__(self, folder: str | Path, budget_bytes: int | None = None, quant: str = "none",
                 namespace: str | None = None, policy=None, model_name: str = "", timeout_s: float = 30.0):
        if quant not in QUANT_MODES:
            raise ValueError(f"kv_quant for the disk tier must be one of {QUANT_MODES}, got {quant!r}")
        self.folder = Path(folder).expanduser()
        try:
            (self.folder / "payloads").mkdir(parents=True, exist_ok=True)
            (self.folder / "tmp").mkdir(exist_ok=True)
        except OSError as exc:
            raise ValueError(f"disk cache folder {self.folder} cannot be created: {exc}") from None
        for sub in ("payloads", "tmp"):
            if not _is_real_dir(self.folder / sub):
                raise ValueError(f"disk cache folder {self.folder}: {sub}/ is not a folder (a link or a file)")
        probe = self.folder / "tmp" / f"probe.{os.getpid()}.{secrets.token_hex(4)}"
        try:  # SQLite's own error for a folder it cannot write to is "unable to open database file"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            if exc.errno != errno.ENOSPC:  # a full disk can still serve what it holds
                raise ValueError(f"disk cache folder {self.folder} is not writable: {exc.strerror or exc}") from None
        self.budget_bytes = budget_bytes  # None until the index is open: the folder's own default, see below
        self.quant = quant
        self.namespace = namespace
        self.policy = policy
        self.model_name = model_name
        self.counters = DiskCounters()
        self.used_bytes = 0  # bytes in the folder at the last index access (read without a lock by memory())
        self.last_error: str | None = None
        self._lock = threading.Lock()
        # One connection, used under self._lock from whichever thread runs the engine.
        conn = sqlite3.connect(self.folder / INDEX_FILENAME, timeout=timeout_s, isolation_level=None,
                               check_same_thread=False)
        self.db = sqlite_utils.Database(conn)
        try:
            self._create_schema()
        except BaseException:
            conn.close()
            raise

    @contextlib.contextmanager
    def _write(self):
        """One write transaction (BEGIN IMMEDIATE: waits for other writers up to the busy timeout). A failed
        ROLLBACK never hides the error that caused it."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            try:
                self.db.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            raise
        self.db.execute("COMMIT")

    def _create_schema(self) -> None:
        with self._lock:
            # Two processes opening a new folder at once race for the journal-mode switch; SQLite answers
            # "locked" at once there instead of waiting, so wait here.
            for attempt in range(100):
                try:
                    self.db.execute("PRAGMA journal_mode=WAL")
                    break
                except sqlite3.OperationalError as exc:
                    if "locked" not in str(exc) and "busy" not in str(exc) or attempt == 99:
                        raise
                    time.sleep(0.05)
            self.db.execute("PRAGMA synchronous=NORMAL")
            if not self._schema_ready():
                try:
                    with self._write():
                        self._write_schema()
                except sqlite3.OperationalError:
                    if not self._tables_ready():
                        raise
                    # a full or locked folder whose tables exist can still be read: the budget is not stored
                    self.budget_bytes = self.budget_bytes or self._folder_budget() or default_disk_budget(self.folder)
            elif self.budget_bytes is None:
                self.budget_bytes = self._folder_budget()
            self._refresh_used()

    def _tables_ready(self) -> bool:
        columns = {row[1] for row in self.db.execute("PRAGMA table_info(entries)").fetchall()}
        tables = {row[0] for row in self.db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        return "lossy" in columns and {"namespaces", "meta"} <= tables

    def _schema_ready(self) -> bool:
        return self._tables_ready() and (self.budget_bytes is not None or self._folder_budget() is not None)

    def _folder_budget(self) -> int | None:
        row = self.db.execute("SELECT value FROM meta WHERE name = 'default_budget_bytes'").fetchone()
        if row is None or isinstance(row[0], bool) or not isinstance(row[0], int) or row[0] < 0:
            return None
        return row[0]

    def _write_schema(self) -> None:
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS entries (id INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT NOT NULL, "
            "namespace TEXT NOT NULL, kind TEXT NOT NULL, parent TEXT NOT NULL, content_key TEXT, "
            "start INTEGER NOT NULL, tokens BLOB NOT NULL, exact INTEGER NOT NULL, num_bytes INTEGER NOT NULL, "
            "raw_bytes INTEGER NOT NULL, importance REAL NOT NULL, hits INTEGER NOT NULL DEFAULT 0, "
            "last_access INTEGER NOT NULL, file TEXT NOT NULL, created REAL NOT NULL, "
            "lossy INTEGER NOT NULL DEFAULT 0, UNIQUE(namespace, key))")
        columns = {row[1] for row in self.db.execute("PRAGMA table_info(entries)").fetchall()}
        if "lossy" not in columns:  # a folder written by an older version
            self.db.execute("ALTER TABLE entries ADD COLUMN lossy INTEGER NOT NULL DEFAULT 0")
        self.db.execute("CREATE INDEX IF NOT EXISTS entries_last_access ON entries(last_access)")
        self.db.execute("CREATE TABLE IF NOT EXISTS namespaces (namespace TEXT PRIMARY KEY, model TEXT, "
                        "settings TEXT, last_used REAL)")
        self.db.execute("CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value)")
        if self.budget_bytes is None:
            # The default budget is the folder's, fixed by the first process that opened it, so the app and the
            # server (each sizing it from free space at its own start) agree.
            budget = self._folder_budget()
            if budget is None:
                budget = default_disk_budget(self.folder)
                self.db.execute("INSERT OR REPLACE INTO meta VALUES ('default_budget_bytes', ?)", [budget])
            self.budget_bytes = budget

    def _refresh_used(self) -> int:
        used = self.db.execute("SELECT COALESCE(SUM(num_bytes), 0) FROM entries").fetchone()[0]
        self.used_bytes = used if isinstance(used, int) else 0
        return self.used_bytes

    def _failed(self, what: str, exc: Exception) -> None:
        self.counters.errors += 1
        self.last_error = f"{what}: {exc}"
        log.warning("disk KV tier: %s failed: %s", what, exc)
        with self._lock:
            try:
                if self.db.conn.in_transaction:
                    self.db.conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass

    @_degrades(None)
    def describe_namespace(self, settings: dict) -> None:
        """Remembers which model/settings a namespace stands for (shown by `kvboost cache stats`)."""
        with self._lock:
            self.db.execute("INSERT OR REPLACE INTO namespaces VALUES (?, ?, ?, ?)",
                            [self.namespace, self.model_name, json.dumps(settings, sort_keys=True), time.time()])

    # -- reading ------------------------------------------------------------------------------------------
    @_degrades([])
    def rows_since(self, last_id: int) -> list[dict]:
        """This namespace's entries added after row id `last_id` (by any process), oldest first, checked by
        parse_row. Rows that fail the check are dropped from the index (the paths they name are not touched)."""
        assert self.namespace is not None
        with self._lock:
            cursor = self.db.execute(
                "SELECT id, key, kind, parent, content_key, start, tokens, exact, num_bytes, raw_bytes, importance, "
                "hits, lossy, file FROM entries WHERE namespace = ? AND id > ? ORDER BY id", [self.namespace, last_id])
            names = [d[0] for d in cursor.description]
            rows = [dict(zip(names, row)) for row in cursor.fetchall()]
        good, bad = [], []
        for row in rows:
            parsed = parse_row(row)
            (good if parsed is not None else bad).append(parsed or row)
        if bad:
            log.warning("disk cache: %d malformed index rows dropped", len(bad))
            self.counters.bad += len(bad)
            self._drop_row_ids([row["id"] for row in bad])
        return good

    def _drop_row_ids(self, ids: list) -> None:
        with self._lock:
            with self._write():
                for row_id in ids:
                    self.db.execute("DELETE FROM entries WHERE id = ?", [row_id])
            self._refresh_used()

    @_degrades(None)
    def load(self, key: bytes, record=None) -> StoredKV | None:
        """The entry's payload, checked; None (and the row removed) when it is missing or cannot be trusted.
        With `record` (the store's record of the row), the file must also be the KV of exactly that entry."""
        t0 = time.perf_counter()
        with self._lock:
            row = self.db.execute("SELECT id, file, num_bytes, lossy FROM entries WHERE namespace = ? AND key = ?",
                                  [self.namespace, key.hex()]).fetchone()
        if row is None:
            return None
        row_id, file, num_bytes, lossy = row
        path = self._safe_path(file, key.hex())
        if path is None or isinstance(num_bytes, bool) or not isinstance(num_bytes, int):
            log.warning("disk cache entry %s dropped: malformed index row", key.hex()[:12])
            self.counters.bad += 1
            self._drop_row_ids([row_id])
            return None
        expect = entry_fields(record, bool(lossy)) if record is not None else None
        try:
            stored = decode_file(path, self.namespace, key, expect=expect, max_bytes=num_bytes)
        except PayloadError as exc:
            log.warning("disk cache entry %s dropped: %s", key.hex()[:12], exc)
            self.counters.bad += 1
            self._delete_rows([(key.hex(), file)])
            return None
        self.counters.reads += 1
        self.counters.read_bytes += stored.nbytes
        self.counters.read_ms += (time.perf_counter() - t0) * 1000
        return stored

    def _safe_path(self, file, key_hex: str | None = None) -> Path | None:
        """The path of a payload file named by a row, or None unless it is a name this tier writes, inside
        payloads/ (no link along the way)."""
        if not is_payload_name(file, key_hex):
            return None
        path = self.folder / file
        return path if _is_real_dir(path.parent) and _is_real_dir(path.parent.parent) else None

    @_degrades(None)
    def touch(self, keys: Iterable[bytes]) -> None:
        """Counts a hit and refreshes recency (a logical clock shared by every process on this folder)."""
        keys = [k.hex() for k in keys]
        if not keys:
            return
        with self._lock:
            with self._write():
                clock = self._clock()
                for i, key in enumerate(keys):
                    self.db.execute("UPDATE entries SET hits = hits + 1, last_access = ? WHERE namespace = ? "
                                    "AND key = ?", [clock + 1 + i, self.namespace, key])

    def _clock(self) -> int:
        clock = self.db.execute("SELECT COALESCE(MAX(last_access), 0) FROM entries").fetchone()[0]
        return clock if isinstance(clock, int) else 0

    # -- writing ------------------------------------------------------------------------------------------
    @_degrades(None)
    def put(self, record, stored: StoredKV, in_use: set[bytes] = frozenset(),
            lossy: bool = False) -> list[bytes] | None:
        """Writes `record`'s payload and indexes it, evicting by the policy to stay within the budget (never
        an entry of this process in use). `lossy`: the payload's values are not the computed ones (quantized,
        or computed over quantized KV); its hits are then reported as QUANTIZED, never EXACT. Returns the keys
        this namespace lost to eviction, or None when the entry does not fit (or the write failed: disk full,
        permissions), in which case nothing is left behind."""
        assert self.namespace is not None
        blob = encode_file(stored, self.namespace, record.key, entry_fields(record, lossy))
        if len(blob) > self.budget_bytes:
            self.counters.rejected += 1
            return None
        rel = payload_name(record.key.hex())
        try:
            self._write_atomic(Path(rel), blob)
        except OSError as exc:
            log.warning("disk cache write failed: %s", exc)
            self.counters.rejected += 1
            return None
        removed: list[tuple[str, str]] = []
        evicted_here: list[bytes] = []
        with self._lock:
            try:
                with self._write():
                    old = self.db.execute("SELECT key, file FROM entries WHERE namespace = ? AND key = ?",
                                          [self.namespace, record.key.hex()]).fetchone()
                    if old is not None:  # a repaired entry or another process's copy: this one replaces it
                        self.db.execute("DELETE FROM entries WHERE namespace = ? AND key = ?",
                                        [self.namespace, record.key.hex()])
                        removed.append(old)
                    used = self._used_in_transaction()
                    if used + len(blob) > self.budget_bytes:
                        victims = self._victims(used + len(blob) - self.budget_bytes, in_use)
                        if victims is None:
                            raise _NoRoom
                        for row_id, key, file, namespace in victims:
                            self.db.execute("DELETE FROM entries WHERE id = ?", [row_id])
                            removed.append((key, file))
                            if namespace == self.namespace and isinstance(key, str) and _HEX_KEY.fullmatch(key):
                                evicted_here.append(bytes.fromhex(key))
                        self.counters.evicted += len(victims)
                    clock = self._clock()
                    self.db.execute(
                        "INSERT INTO entries (key, namespace, kind, parent, content_key, start, tokens, exact, "
                        "num_bytes, raw_bytes, importance, hits, last_access, file, created, lossy) "
                        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        [record.key.hex(), self.namespace, record.kind, record.parent.hex(),
                         record.content_key.hex() if record.content_key else None, record.start,
                         np.asarray(record.tokens, dtype="<i4").tobytes(), int(record.exact), len(blob),
                         record.num_bytes, record.importance, record.hits, clock + 1, rel, time.time(),
                         int(lossy)])
            except _NoRoom:  # the old row (if any) stays, with its file
                self._unlink([rel])
                self.counters.rejected += 1
                return None
            except BaseException:
                self._unlink([rel])
                raise
            self._refresh_used()
        self._unlink([f for _, f in removed])
        self.counters.writes += 1
        return evicted_here

    def _used_in_transaction(self) -> int:
        used = self.db.execute("SELECT COALESCE(SUM(num_bytes), 0) FROM entries").fetchone()[0]
        return used if isinstance(used, int) else 0

    def _victims(self, need: int, in_use: set[bytes]) -> list[tuple] | None:
        """Rows to drop, in the policy's order, freeing at least `need` bytes; None when impossible. Rows with
        malformed bookkeeping go first (they cannot be served anyway)."""
        rows = self.db.execute("SELECT id, key, file, namespace, num_bytes, importance, hits, last_access "
                               "FROM entries").fetchall()
        broken, candidates = [], []
        for row_id, key, file, namespace, num_bytes, importance, hits, last_access in rows:
            numbers = (num_bytes, hits, last_access)
            if not isinstance(key, str) or any(isinstance(v, bool) or not isinstance(v, int) for v in numbers) \
                    or not isinstance(importance, (int, float)):
                broken.append((row_id, key, file, namespace))
                continue
            if namespace == self.namespace and _HEX_KEY.fullmatch(key) and bytes.fromhex(key) in in_use:
                continue
            candidates.append(Candidate(last_access, hits, float(importance),
                                        ref=((row_id, key, file, namespace), num_bytes)))
        victims, freed = list(broken), 0
        for candidate in rank(self.policy or LRU(), candidates):
            if freed >= need:
                break
            victim, num_bytes = candidate.ref
            victims.append(victim)
            freed += num_bytes
        return victims if freed >= need else None

    def _write_atomic(self, rel: Path, blob: bytes) -> None:
        final = self.folder / rel
        final.parent.mkdir(parents=True, exist_ok=True)
        if not _is_real_dir(final.parent):
            raise OSError(f"{final.parent} is not a folder")
        tmp = self.folder / "tmp" / f"{final.name}.{os.getpid()}.tmp"
        try:
            with open(tmp, "xb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(final.parent)

    @_degrades(None)
    def remove(self, keys: Iterable[bytes]) -> None:
        keys = [k.hex() for k in keys]
        with self._lock:
            rows = [self.db.execute("SELECT key, file FROM entries WHERE namespace = ? AND key = ?",
                                    [self.namespace, k]).fetchone() for k in keys]
        self._delete_rows([r for r in rows if r is not None])

    def _delete_rows(self, rows: list[tuple[str, str]]) -> None:
        with self._lock:
            with self._write():
                for key, file in rows:
                    self.db.execute("DELETE FROM entries WHERE namespace = ? AND key = ? AND file = ?",
                                    [self.namespace, key, file])
            self._refresh_used()
        self._unlink([file for _, file in rows])

    def _unlink(self, files: Iterable) -> None:
        """Removes payload files named by rows; a name this tier would not write is left alone."""
        for file in files:
            path = self._safe_path(file)
            if path is None:
                continue
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                log.warning("could not remove %s: %s", file, exc)

    # -- maintenance ----------------------------------------------------------------------------------------
    @_degrades(lambda self: self.used_bytes)
    def num_bytes(self) -> int:
        with self._lock:
            return self._refresh_used()

    # Maintenance (kvboost cache stats | clear | verify): engine.kv.disk_maintenance.
    def stats(self) -> dict:
        return disk_maintenance.stats(self)

    def clear(self, namespace: str | None = None) -> int:
        """Removes every entry (of `namespace` when given); returns how many."""
        return disk_maintenance.clear(self, namespace)

    def verify(self, repair: bool = True) -> dict:
        """Every file checked against its row; see engine.kv.disk_maintenance.verify."""
        return disk_maintenance.verify(self, repair)

    def close(self) -> None:
        with self._lock:
            self.db.conn.close()


class _NoRoom(Exception):
    pass


def _is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # not possible on every platform (Windows); the rename is still atomic
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
