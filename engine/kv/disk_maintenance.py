"""Maintenance of a disk KV folder (`kvboost cache stats | clear | verify`): where it is, what it holds, emptying
it, and checking every file against its row, the debris of crashes included. Works on an open engine.kv.disk.DiskTier
(namespace None for every model's entries), except `read_stats` and `default_cache_dir`, which need no torch: the
CLI answers `kvboost cache stats` with them at once."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import time
from pathlib import Path
from types import SimpleNamespace

import platformdirs

from .disk_rows import _TMP_NAME, entry_fields, is_payload_name, parse_row

CACHE_DIR_ENV_VAR = "KVBOOST_CACHE_DIR"
INDEX_FILENAME = "index.sqlite3"
ORPHAN_AGE_S = 3600  # a file without a row older than this is debris of a crash (a writer renames then commits)


def default_cache_dir() -> Path:
    """$KVBOOST_CACHE_DIR when set (documented override), else platformdirs' per-user cache folder."""
    override = os.environ.get(CACHE_DIR_ENV_VAR)
    if override:
        return Path(override).expanduser()
    return Path(platformdirs.user_cache_dir("KVBoost", "KVBoost")) / "kv"


def stats(disk) -> dict:
    """Entries, bytes and tokens in the folder, in all and per namespace (model and settings)."""
    with disk._lock:
        return _stats(disk.db.execute, disk.folder, disk.budget_bytes)


def read_stats(folder: Path) -> dict | None:
    """stats() of the folder's index opened read-only, without a DiskTier (nothing written, no torch); None when
    the folder holds no index. Its budget is None: a budget belongs to an engine, not to the folder."""
    index = folder / INDEX_FILENAME
    if not index.is_file():
        return None
    import sqlite3

    conn = sqlite3.connect(f"{index.resolve().as_uri()}?mode=ro", uri=True, timeout=30.0)
    try:
        return _stats(conn.execute, folder, None)
    finally:
        conn.close()


def _stats(execute, folder: Path, budget_bytes: int | None) -> dict:
    total = execute("SELECT COUNT(*), COALESCE(SUM(num_bytes), 0), COALESCE(SUM(raw_bytes), 0), "
                    "COALESCE(SUM(LENGTH(tokens)) / 4, 0) FROM entries").fetchone()
    per_ns = execute(
        "SELECT e.namespace, n.model, n.settings, COUNT(*), SUM(e.num_bytes), SUM(LENGTH(e.tokens)) / 4 "
        "FROM entries e LEFT JOIN namespaces n ON n.namespace = e.namespace GROUP BY e.namespace "
        "ORDER BY SUM(e.num_bytes) DESC").fetchall()
    return {
        "folder": str(folder), "entries": total[0], "bytes": total[1], "raw_bytes": total[2],
        "tokens": total[3], "budget_bytes": budget_bytes,
        "namespaces": [{"namespace": ns, "model": model or "?", "settings": _json_dict(settings),
                        "entries": n, "bytes": b, "tokens": t} for ns, model, settings, n, b, t in per_ns],
    }


def clear(disk, namespace: str | None = None) -> int:
    """Removes every entry (of `namespace` when given); returns how many."""
    with disk._lock:
        where, args = ("WHERE namespace = ?", [namespace]) if namespace else ("", [])
        rows = disk.db.execute(f"SELECT key, file FROM entries {where}", args).fetchall()
        disk.db.execute(f"DELETE FROM entries {where}", args)
        disk._refresh_used()
    disk._unlink([file for _, file in rows])
    if namespace is None:
        remove_unreferenced(disk, min_age_s=0)
    return len(rows)


def verify(disk, repair: bool = True) -> dict:
    """Reads every file against its row: malformed rows, missing, truncated, corrupt or mismatched files
    are reported (and with `repair` their rows dropped; a malformed row's path is never touched); files no
    row points to (a crash between rename and commit) are removed when older than ORPHAN_AGE_S."""
    from .payload_file import PayloadError, decode_file  # torch: only where files are read

    with disk._lock:
        cursor = disk.db.execute(
            "SELECT id, namespace, key, kind, parent, content_key, start, tokens, exact, num_bytes, raw_bytes, "
            "importance, hits, lossy, file FROM entries")
        names = [d[0] for d in cursor.description]
        rows = [dict(zip(names, row)) for row in cursor.fetchall()]
    bad = []
    for row in rows:
        parsed = parse_row(row)
        problem = None
        if parsed is None:
            problem = "malformed index row"
        else:
            path = disk._safe_path(row["file"], row["key"])
            try:
                if path is None:
                    raise PayloadError("file name outside the payload folder")
                decode_file(path, row["namespace"], parsed["key"],
                            expect=entry_fields(SimpleNamespace(**parsed), parsed["lossy"]),
                            max_bytes=parsed["num_bytes"])
            except PayloadError as exc:
                problem = str(exc)
        if problem is not None:
            bad.append({"id": row["id"], "key": row["key"], "file": row["file"], "problem": problem,
                        "namespace": row["namespace"], "trusted_name": parsed is not None})
    if repair and bad:
        with disk._lock:
            with disk._write():
                for b in bad:
                    disk.db.execute("DELETE FROM entries WHERE id = ?", [b["id"]])
            disk._refresh_used()
        disk._unlink([b["file"] for b in bad if b["trusted_name"]])
    for b in bad:
        del b["id"], b["trusted_name"]
        if not isinstance(b["file"], str):
            b["file"] = repr(b["file"])
        if not isinstance(b["key"], str):
            b["key"] = repr(b["key"])
    orphans = remove_unreferenced(disk, min_age_s=ORPHAN_AGE_S) if repair else []
    return {"checked": len(rows), "bad": bad, "orphans_removed": orphans}

def remove_unreferenced(disk, min_age_s: float) -> list[str]:
    """Payload and temp files no row names (only names this tier writes; links are removed as links)."""
    with disk._lock:
        referenced = {row[0] for row in disk.db.execute("SELECT file FROM entries").fetchall()}
    now = time.time()
    candidates = []
    for sub in ("payloads", "tmp"):
        top = disk.folder / sub
        for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
            for name in filenames:
                rel = Path(dirpath, name).relative_to(disk.folder).as_posix()
                if is_payload_name(rel) or _TMP_NAME.fullmatch(rel):
                    candidates.append(rel)
    removed = []
    for rel in candidates:
        path = disk.folder / rel
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if not (stat.S_ISREG(info.st_mode) or stat.S_ISLNK(info.st_mode)):
            continue
        if rel not in referenced and now - info.st_mtime >= min_age_s:
            with contextlib.suppress(OSError):
                path.unlink()
                removed.append(rel)
    return removed


def _json_dict(text) -> dict:
    try:
        value = json.loads(text or "{}")
    except (TypeError, ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}
