"""The values the app's database stores, checked and encoded: roles, statuses, sampling, JSON columns, passages
and document paths (any path the OS gives, also one that is not valid Unicode). No Qt here."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

DEFAULT_SAMPLING = {"temperature": 0.2, "top_p": 0.9, "max_new_tokens": 512}  # SmolLM2 model card: 0.2 / 0.9

ROLES = ("system", "user", "assistant")
# "streaming": being written right now; a streaming row found at start-up means the app died mid-answer.
STATUSES = ("done", "streaming", "interrupted", "cancelled", "error")

DEFAULT_TITLE = "New chat"  # a conversation named so takes its first question's words (Database.title_if_untitled)
TITLE_CHARS = 48

_JSON_COLUMNS = ("sampling", "stats", "sources")


def fts_string(word: str) -> str:
    """`word` as an FTS5 string literal, so no character in it is read as query syntax."""
    return '"' + word.replace('"', '""') + '"'


def title_from_question(question: str) -> str:
    """The opening words of a question, at most TITLE_CHARS characters, cut at a word."""
    words = " ".join(question.split())
    if len(words) <= TITLE_CHARS:
        return words or DEFAULT_TITLE
    cut = words[:TITLE_CHARS + 1].rsplit(" ", 1)[0] if " " in words[:TITLE_CHARS + 1] else words[:TITLE_CHARS]
    return cut.rstrip(" ,.;:!?-") + "…"


def encode_json(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"value is not JSON-serialisable: {value!r} ({exc})") from None


def decoded(row: dict) -> dict:
    for column in _JSON_COLUMNS:
        if row.get(column) is not None:
            row[column] = json.loads(row[column])
    return row


def check_role(role: Any) -> None:
    if role not in ROLES:
        raise ValueError(f"message role must be one of {ROLES}, got {role!r}")


def check_status(status: Any) -> None:
    if status not in STATUSES:
        raise ValueError(f"message status must be one of {STATUSES}, got {status!r}")


def merged_sampling(base: dict, overrides: Any) -> dict:
    """`overrides` (a dict of some sampling keys, or None) over `base`, checked."""
    if overrides is not None and not isinstance(overrides, dict):
        raise ValueError(f"sampling must be a dict, got {type(overrides).__name__}")
    sampling = {**base, **(overrides or {})}
    unknown = sorted(set(sampling) - set(DEFAULT_SAMPLING))
    if unknown:
        raise ValueError(f"unknown sampling keys {unknown}; allowed: {sorted(DEFAULT_SAMPLING)}")
    for key, value in sampling.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"sampling {key} must be a number, got {value!r}")
    if not isinstance(sampling["max_new_tokens"], int) or sampling["max_new_tokens"] < 1:
        raise ValueError(f"sampling max_new_tokens must be a positive integer, got {sampling['max_new_tokens']!r}")
    return sampling


def validated_passage(index: int, passage: Any) -> dict:
    if not isinstance(passage, dict) or not isinstance(passage.get("text"), str):
        raise ValueError(f"passage {index} must be a dict with a str 'text', got {passage!r:.200}")
    try:
        return {
            "seq": index,
            "text": passage["text"],
            "page": passage.get("page"),
            "section": passage.get("section"),
            "start": int(passage["start"]),
            "end": int(passage["end"]),
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"passage {index} needs integer 'start' and 'end' offsets ({exc!r})") from None


# Python holds bytes of a file name that are not valid in the file system's encoding as lone surrogates,
# which SQLite (UTF-8) cannot store. Such a path is stored as this mark + its bytes read as Latin-1: lossless,
# and never equal to a real path, since no OS allows NUL in one.
_UNDECODABLE_PATH_MARK = "\x00"
_LONE_SURROGATES = re.compile("[\ud800-\udfff]")


def stored_path(path: str | Path) -> str:
    """A document's path as the documents table keeps it (valid Unicode paths unchanged)."""
    text = str(path)
    if not _LONE_SURROGATES.search(text):
        return text
    return _UNDECODABLE_PATH_MARK + os.fsencode(text).decode("latin-1")


def document_row(row: dict) -> dict:
    """A documents row with its path as the OS gave it."""
    if row["path"].startswith(_UNDECODABLE_PATH_MARK):
        row["path"] = os.fsdecode(row["path"][len(_UNDECODABLE_PATH_MARK):].encode("latin-1"))
    return row


def display_name(name: str) -> str:
    """A file name to show: bytes of it that are not text (lone surrogates) as U+FFFD."""
    return _LONE_SURROGATES.sub("\ufffd", name)
