"""Conversations as files: JSON export/import (validated before anything is written) and Markdown export."""

from __future__ import annotations

from typing import Any

from .db import DEFAULT_SAMPLING, DEFAULT_SYSTEM_PROMPT, ROLES, Database, encode_json, merged_sampling

EXPORT_FORMAT = "kvboost-conversation"
EXPORT_VERSION = 1


def export_json(db: Database, cid: int) -> dict:
    conversation = db.conversation(cid)
    return {
        "format": EXPORT_FORMAT,
        "version": EXPORT_VERSION,
        "title": conversation["title"],
        "system_prompt": conversation["system_prompt"],
        "sampling": conversation["sampling"],
        "created_at": conversation["created_at"],
        "messages": [
            {key: message[key] for key in ("role", "content", "created_at", "stats", "sources")}
            for message in db.messages(cid)
        ],
    }


def export_markdown(db: Database, cid: int) -> str:
    conversation = db.conversation(cid)
    parts = [f"# {conversation['title']}"]
    if conversation["system_prompt"]:
        parts.append("\n".join(f"> {line}".rstrip() for line in conversation["system_prompt"].splitlines()))
    for message in db.messages(cid):
        parts.append(f"**{message['role'].capitalize()}**")
        parts.append(message["content"])
    return "\n\n".join(parts) + "\n"


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
