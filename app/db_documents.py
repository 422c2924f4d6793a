"""The documents a user dropped and their passages, in the app's SQLite file (part of app.db.Database).

A document row is shared by every conversation it is attached to; re-indexing a file keeps its id, so its
attachments survive. Passages are searched with FTS5 (bm25) within one conversation's documents.
"""

from __future__ import annotations

import re
from pathlib import Path

from sqlite_utils.db import NotFoundError

from .db_values import display_name, document_row, fts_string, stored_path, validated_passage

# Dropped from document questions so "what is the eviction policy?" ranks on "eviction" and "policy".
_STOPWORDS = frozenset(
    """a about an and are as at be been but by can could did do does doing for from had has have how i if in
    into is it its me my no not of on or our please should so such than that the their them then there these
    they this those to was we were what when where which who whom why will with would you your""".split()
)



class DocumentTables:
    """The documents half of Database: it uses Database's `_db` (sqlite-utils), `_clock` and `conversation()`."""

    def find_document(self, path: str | Path) -> dict | None:
        rows = list(self._db.query("SELECT * FROM documents WHERE path = ?", [stored_path(path)]))
        return document_row(rows[0]) if rows else None

    def upsert_document(
        self,
        path: str | Path,
        name: str,
        kind: str,
        sha256: str,
        mtime: float,
        size: int,
        num_chars: int,
        passages: list[dict],
    ) -> dict:
        """Add a document, or re-index the one at `path`: its id (and so its attachments) and added_at stay,
        its passages are replaced. Passages are dicts with text, page, section, start, end; seq = list order.

        Any path the OS gives is stored, also one whose name is not valid UTF-8 (see app.db_values.stored_path); `name`
        is
        for display, so bytes of it that are not text are kept as U+FFFD.
        """
        passage_rows = [validated_passage(index, passage) for index, passage in enumerate(passages)]
        name = display_name(name)
        fields = {"name": name, "kind": kind, "sha256": sha256, "mtime": mtime, "size": size, "num_chars": num_chars}
        with self._db.atomic():
            existing = self.find_document(path)
            if existing is None:
                doc_id = self._db["documents"].insert(
                    {"path": stored_path(path), **fields, "added_at": self._clock()}
                ).last_pk
            else:
                doc_id = existing["id"]
                self._db["documents"].update(doc_id, fields)
                self._db.execute("DELETE FROM passages WHERE document_id = ?", [doc_id])
            self._db["passages"].insert_all({"document_id": doc_id, **row} for row in passage_rows)
        return self.find_document(path)

    def upsert_document_signature(self, doc_id: int, mtime: float, size: int) -> dict:
        """Record a new mtime/size for a document whose bytes (sha256) did not change; passages stay."""
        try:
            self._db["documents"].update(doc_id, {"mtime": mtime, "size": size})
        except NotFoundError:
            raise KeyError(f"no document with id {doc_id}") from None
        return document_row(self._db["documents"].get(doc_id))

    def passages(self, doc_id: int) -> list[dict]:
        return list(self._db.query("SELECT * FROM passages WHERE document_id = ? ORDER BY seq", [doc_id]))

    def attach_document(self, cid: int, doc_id: int) -> None:
        """Attach at the end of the conversation's document list; attaching twice changes nothing."""
        with self._db.atomic():
            self.conversation(cid)
            if not list(self._db.query("SELECT id FROM documents WHERE id = ?", [doc_id])):
                raise KeyError(f"no document with id {doc_id}")
            self._db.execute(
                """
                INSERT OR IGNORE INTO conversation_documents (conversation_id, document_id, added_at, position)
                VALUES (?, ?, ?, (SELECT COALESCE(MAX(position), -1) + 1 FROM conversation_documents
                                  WHERE conversation_id = ?))
                """,
                [cid, doc_id, self._clock(), cid],
            )

    def detach_document(self, cid: int, doc_id: int) -> None:
        with self._db.atomic():
            self._db.execute(
                "DELETE FROM conversation_documents WHERE conversation_id = ? AND document_id = ?", [cid, doc_id]
            )

    def conversation_documents(self, cid: int) -> list[dict]:
        """Document rows plus `position` and `attached_at` of the attachment, in attachment order."""
        rows = self._db.query(
            """
            SELECT d.*, cd.position, cd.added_at AS attached_at
            FROM conversation_documents AS cd JOIN documents AS d ON d.id = cd.document_id
            WHERE cd.conversation_id = ?
            ORDER BY cd.position
            """,
            [cid],
        )
        return [document_row(row) for row in rows]

    def search_passages(self, cid: int, query: str, limit: int = 5) -> list[dict]:
        """Passages of the documents attached to `cid` that contain any content word of `query`.

        score = -bm25, so higher is better and a passage matching more of the question's terms ranks first.
        Stopwords and one-character words are dropped; a question made only of them finds nothing.
        """
        terms = list(dict.fromkeys(w for w in re.findall(r"\w+", query.lower()) if len(w) > 1 and w not in _STOPWORDS))
        if not terms:
            return []
        rows = self._db.query(
            """
            SELECT p.id, p.document_id, d.name, d.path, p.page, p.section, p.start, p."end", p.text,
                   -bm25(passages_fts) AS score
            FROM passages_fts
            JOIN passages AS p ON p.id = passages_fts.rowid
            JOIN documents AS d ON d.id = p.document_id
            JOIN conversation_documents AS cd ON cd.document_id = p.document_id AND cd.conversation_id = ?
            WHERE passages_fts MATCH ?
            ORDER BY score DESC, p.document_id, p.seq
            LIMIT ?
            """,
            [cid, " OR ".join(fts_string(term) for term in terms), limit],
        )
        return [document_row(row) for row in rows]
