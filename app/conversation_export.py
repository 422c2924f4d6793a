"""Conversations as files: JSON export/import (validated before anything is written) and Markdown export."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from .db import DEFAULT_SAMPLING, DEFAULT_SYSTEM_PROMPT, ROLES, Database, encode_json, merged_sampling

EXPORT_FORMAT = "kvboost-conversation"
EXPORT_VERSION = 1


# Characters no file name may hold on Windows, macOS or Linux (and control characters)
_UNSAFE = re.compile(r'[<>:"/\\|?*\x00-\x1f\x7f]+')
_RESERVED = {"con", "prn", "aux", "nul", *(f"com{i}" for i in range(1, 10)), *(f"lpt{i}" for i in range(1, 10))}
MAX_NAME_CHARS = 80


def safe_file_name(title: str, suffix: str) -> str:
    """A file name for a conversation titled `title` that every desktop OS accepts: unsafe characters become
    "-", no leading or trailing dots or spaces, at most MAX_NAME_CHARS characters, "conversation" when nothing is
    left (or the name is one Windows reserves)."""
    name = _UNSAFE.sub("-", title).strip(" .-")
    name = re.sub(r"\s+", " ", name)[:MAX_NAME_CHARS].rstrip(" .-")
    if not name or name.lower() in _RESERVED:
        name = "conversation"
    return f"{name}.{suffix}"


def suggested_path(folder: Path, title: str, suffix: str) -> Path:
    """Where an export of `title` is offered: `folder` (the user's documents folder) and a safe name."""
    return folder / safe_file_name(title, suffix)


def _documents(db: Database, cid: int) -> list[dict]:
    return [{key: doc[key] for key in ("name", "path", "kind", "sha256", "size")}
            for doc in db.conversation_documents(cid)]


def export_json(db: Database, cid: int) -> dict:
    """The conversation as data: its settings, the documents attached to it, and every message with its stats
    (the answering model among them) and sources. `import_json` reads it back (documents are listed, not
    imported: their files stay where they are)."""
    conversation = db.conversation(cid)
    return {
        "format": EXPORT_FORMAT,
        "version": EXPORT_VERSION,
        "title": conversation["title"],
        "system_prompt": conversation["system_prompt"],
        "sampling": conversation["sampling"],
        "created_at": conversation["created_at"],
        "documents": _documents(db, cid),
        "messages": [
            {key: message[key] for key in ("role", "content", "created_at", "stats", "sources")}
            for message in db.messages(cid)
        ],
    }


def export_markdown(db: Database, cid: int) -> str:
    """The conversation to read: title, system prompt, the documents attached, then each message, an answer
    followed by the model that gave it and its sources."""
    conversation = db.conversation(cid)
    parts = [f"# {conversation['title']}"]
    if conversation["system_prompt"]:
        parts.append("\n".join(f"> {line}".rstrip() for line in conversation["system_prompt"].splitlines()))
    documents = _documents(db, cid)
    if documents:
        parts.append("Documents:\n" + "\n".join(f"- {doc['name']} ({doc['path']})" for doc in documents))
    for message in db.messages(cid):
        parts.append(f"**{message['role'].capitalize()}**")
        parts.append(message["content"])
        model = (message.get("stats") or {}).get("model")
        sources = message.get("sources") or []
        notes = ([f"*Model: {model}*"] if model else []) + (
            ["*Sources: " + ", ".join(_source(s) for s in sources) + "*"] if sources else [])
        if notes:
            parts.append("\n".join(notes))
    return "\n\n".join(parts) + "\n"


def _source(source: dict) -> str:
    where = f" p.{source['page']}" if source.get("page") else ""
    return f"{source.get('name', '?')}{where}"


def import_json(db: Database, data: Any) -> dict:
    """A new open conversation from an `export_json` dict. Raises ValueError, writing nothing, on bad input."""
    conversation, messages = _validated_import(data, now=db.now())
    return db.add_conversation_with_messages(conversation, messages)


def _validated_import(data: Any, now: float) -> tuple[dict, list[dict]]:
    """(conversation row, message rows) from an export dict; every check runs before anything is written."""
    if not isinstance(data, dict):
        raise ValueError(f"a conversation export must be a JSON object, got {type(data).__name__}")
    if data.get("format") != EXPORT_FORMAT:
        raise ValueError(
            f"not a KVBoost conversation export: format is {data.get('format')!r}, expected {EXPORT_FORMAT!r}"
        )
    version = data.get("version")
    if isinstance(version, bool) or version != EXPORT_VERSION:
        raise ValueError(
            f"unsupported conversation export version {version!r}; this app reads version {EXPORT_VERSION}"
        )
    raw_messages = data.get("messages")
    if not isinstance(raw_messages, list):
        raise ValueError(f"a conversation export needs a 'messages' list, got {type(raw_messages).__name__}")
    title = data.get("title", "Imported chat")
    system_prompt = data.get("system_prompt")
    if not isinstance(title, str):
        raise ValueError(f"title must be a str, got {title!r}")
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise ValueError(f"system_prompt must be a str or null, got {system_prompt!r}")
    sampling = merged_sampling(DEFAULT_SAMPLING, data.get("sampling"))
    created_at = _timestamp(data.get("created_at"), now, "created_at")

    messages = []
    for index, message in enumerate(raw_messages):
        if not isinstance(message, dict):
            raise ValueError(f"message {index} must be an object, got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(f"message {index}: role must be one of {ROLES}, got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"message {index}: content must be a str, got {type(content).__name__}")
        stats, sources = message.get("stats"), message.get("sources")
        messages.append(
            {
                "role": role,
                "content": content,
                "stats": None if stats is None else encode_json(stats),
                "sources": None if sources is None else encode_json(sources),
                "created_at": _timestamp(message.get("created_at"), now, f"message {index} created_at"),
            }
        )
    conversation = {
        "title": title,
        "system_prompt": DEFAULT_SYSTEM_PROMPT if system_prompt is None else system_prompt,
        "sampling": encode_json(sampling),
        "created_at": created_at,
        "updated_at": now,
        "is_open": 1,
    }
    return conversation, messages


def _timestamp(value: Any, default: float, what: str) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a unix time in seconds, got {value!r}")
    return float(value)
