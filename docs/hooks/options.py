"""MkDocs hook: the options reference (docs/options.md) generated from the option dataclasses of engine.config,
so an option's name, default and help are written once, in its field."""

from __future__ import annotations

import dataclasses
import inspect

MARKER = "<!-- options -->"


def _default(f: dataclasses.Field) -> str:
    if f.default_factory is not dataclasses.MISSING:
        return f"`{f.default_factory.__name__}()`"
    return f"`{f.default!r}`"


def _table(config_class) -> list[str]:
    rows = [f"### `{config_class.__name__}`", "", inspect.cleandoc(config_class.__doc__ or ""), "",
            "| option | default | what it does |", "|---|---|---|"]
    for f in dataclasses.fields(config_class):
        text = f.metadata.get("help", "").replace("|", "\\|")
        rows.append(f"| `{f.name}` | {_default(f)} | {text} |")
    return rows + [""]


def reference() -> str:
    from engine.config import ChunkingConfig, EngineConfig, KVQuantConfig, RepairConfig, SamplingConfig

    lines = []
    for config_class in (EngineConfig, ChunkingConfig, RepairConfig, KVQuantConfig, SamplingConfig):
        lines += _table(config_class)
    return "\n".join(lines)


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, reference())
