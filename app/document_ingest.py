"""Dropped files and folders into a conversation: each file read (in a worker process, app.document_worker),
stored as a document with its passages and attached; unchanged files cost nothing. No widgets: the conversation
tab runs `Ingest.run` on its event loop and shows the progress it reports.

Hashing files and waiting on the processes that read them run on threads of their own, never on the UI thread
(and never on the engine thread).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable
from pathlib import Path

from . import document_worker, documents
from .background import executor

log = logging.getLogger(__name__)

_FILE_WORKERS = executor("kvboost-files", workers=2)


class Ingest:
    """One drop: `run(paths)` indexes and attaches the files; `cancel_reading()` stops the file being read now
    (its process), from any thread, at once."""

    def __init__(self, db, conversation_id: int, limits: document_worker.ExtractionLimits):
        self.db, self.conversation_id, self.limits = db, conversation_id, limits
        self._reading = threading.Event()  # the cancel event of the file being read

    def cancel_reading(self) -> None:
        self._reading.set()

    async def run(self, paths: list[str], started: Callable[[int], None], progressed: Callable[[int], None]) -> dict:
        """{"added", "unchanged", "problems"}: files attached (new or changed), already there, and what could
        not be added and why. `started(number of files)`, then `progressed(files done)` after each."""
        loop = asyncio.get_running_loop()
        files, skipped = documents.collect_files(paths)
        problems = [f"{documents.display_name(p)}: {why}" for p, why in skipped]
        added = unchanged = 0
        started(len(files))
        for i, path in enumerate(files):
            try:
                doc, changed = await self._index_file(loop, path)
                attached = {d["id"] for d in self.db.conversation_documents(self.conversation_id)}
                if doc["id"] not in attached:
                    self.db.attach_document(self.conversation_id, doc["id"])
                    added += 1
                elif changed:
                    added += 1
                else:
                    unchanged += 1
            except documents.DocumentError as exc:
                problems.append(str(exc))
            except Exception as exc:  # a bad file never takes the app down
                log.exception("indexing %s failed", path)
                problems.append(f"{documents.display_name(path)}: {type(exc).__name__}: {exc}")
            progressed(i + 1)
        return {"added": added, "unchanged": unchanged, "problems": problems}

    async def _index_file(self, loop, path: Path) -> tuple[dict, bool]:
        """(document row, whether its content changed). Unchanged path + mtime + size: no work at all;
        touched but same bytes (sha256): only the row's mtime is refreshed."""
        known = self.db.find_document(str(path))
        mtime, size = documents.file_signature(path)
        if known and known["mtime"] == mtime and known["size"] == size:
            return known, False
        if known and known["size"] == size:
            # Touched, at the size it was taken at: hashing reads no more than adding it did (a file growing
            # meanwhile is read no further, and is read again below, under the limit).
            try:
                digest = await loop.run_in_executor(_FILE_WORKERS, documents.sha256_file, path, size)
            except documents.DocumentError:
                digest = None
            if digest == known["sha256"]:
                return self.db.upsert_document_signature(known["id"], mtime, size), False
        # Checked at every read, not only the first: a document that grew past the limit since it was added is
        # refused here, before a byte of it is read (and then at most the limit + 1 bytes are).
        documents.check_size(path, size, self.limits.max_bytes)
        self._reading = cancelled = threading.Event()
        read = functools.partial(document_worker.shared_pool().extract, path, self.limits, cancelled)
        try:
            doc = await loop.run_in_executor(_FILE_WORKERS, read)
        except asyncio.CancelledError:  # however the task was cancelled, stop the process reading the file too
            cancelled.set()
            raise
        row = self.db.upsert_document(
            doc.path, doc.name, doc.kind, doc.sha256, doc.mtime, doc.size, len(doc.text),
            [{"text": p.text, "page": p.page, "section": p.section, "start": p.start, "end": p.end}
             for p in doc.passages],
        )
        return row, True
