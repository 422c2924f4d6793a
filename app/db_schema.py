"""The app database's schema, as migrations: MIGRATIONS[i] takes a file from schema version i to i + 1."""

from __future__ import annotations

from collections.abc import Callable

import sqlite_utils


def migrate_to_v1(db: sqlite_utils.Database) -> None:
    db.executescript(
        """
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE conversations (
            id INTEGER PRIMARY KEY,
            title TEXT NOT NULL,
            system_prompt TEXT NOT NULL,
            sampling TEXT NOT NULL,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL,
            is_open INTEGER NOT NULL DEFAULT 1,
            tab_order INTEGER NOT NULL DEFAULT 0
        );
        CREATE TABLE messages (
            id INTEGER PRIMARY KEY,
            conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            position INTEGER NOT NULL,
            role TEXT NOT NULL,
            content TEXT NOT NULL,
            prompt TEXT,
            status TEXT NOT NULL DEFAULT 'done',
            stats TEXT,
            sources TEXT,
            created_at REAL NOT NULL,
            UNIQUE (conversation_id, position)
        );
        CREATE TABLE documents (
            id INTEGER PRIMARY KEY,
            path TEXT NOT NULL UNIQUE,
            name TEXT NOT NULL,
            kind TEXT NOT NULL,
            sha256 TEXT NOT NULL,
            mtime REAL NOT NULL,
            size INTEGER NOT NULL,
            num_chars INTEGER NOT NULL,
            added_at REAL NOT NULL
        );
        CREATE TABLE passages (
            id INTEGER PRIMARY KEY,
            document_id INTEGER NOT NULL REFERENCES documents(id) ON DELETE CASCADE,
            seq INTEGER NOT NULL,
            text TEXT NOT NULL,
            page INTEGER,
            section TEXT,
            start INTEGER NOT NULL,
            "end" INTEGER NOT NULL,
            UNIQUE (document_id, seq)
        );
        CREATE TABLE conversation_documents (
            conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            document_id INTEGER NOT NULL REFERENCES documents(id) ON DELETE CASCADE,
            added_at REAL NOT NULL,
            position INTEGER NOT NULL,
            PRIMARY KEY (conversation_id, document_id)
        );
        CREATE INDEX conversation_documents_by_document ON conversation_documents (document_id);
        CREATE TABLE settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        """
    )
    # External-content FTS5 tables kept in sync by insert/update/delete triggers; porter stems so that
    # "running" finds "runs".
    db["messages"].enable_fts(["content"], create_triggers=True, tokenize="porter")
    db["passages"].enable_fts(["text"], create_triggers=True, tokenize="porter")


# MIGRATIONS[i] takes the schema from version i to i + 1. Append only: never edit a released migration.
MIGRATIONS: list[Callable[[sqlite_utils.Database], None]] = [migrate_to_v1]
