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


def _table(config_class, flat: dict) -> list[str]:
    """`flat`: field -> its keyword / flag name (engine.config.options), for the fields that have one."""
    rows = [f"### `{config_class.__name__}`", "", inspect.cleandoc(config_class.__doc__ or ""), "",
            "| field | keyword and flag | default | allowed | what it does |", "|---|---|---|---|---|"]
    for f in dataclasses.fields(config_class):
        text = f.metadata.get("help", "").replace("|", "\\|")
        name = flat.get(f.name)
        keyword = f"`{name}`, `--{name.replace('_', '-')}`" if name else "(fields below)"
        choices = f.metadata.get("choices")
        allowed = ", ".join(f"`{c!r}`" for c in choices).replace("|", "\\|") if choices else ""
        if not allowed and f.metadata.get("kind"):  # what engine.config.check_fields holds it to
            from engine.config import _wanted

            allowed = _wanted(f.metadata)
        rows.append(f"| `{f.name}` | {keyword} | {_default(f)} | {allowed} | {text} |")
    return rows + [""]


def _class_at(owner: type, path: tuple[str, ...]) -> type:
    """The dataclass the fields at `path` below `owner` belong to (("reuse", "chunking"): ChunkingConfig)."""
    for name in path:
        owner = next(f.default_factory for f in dataclasses.fields(owner) if f.name == name)
    return owner


def reference() -> str:
    from engine.config import (
        ChunkingConfig,
        DecodeConfig,
        EngineConfig,
        KVQuantConfig,
        LoadOptions,
        RepairConfig,
        ReuseConfig,
        SamplingConfig,
        TierConfig,
        options,
    )

    flat: dict[type, dict[str, str]] = {}
    for name, opt in options().items():
        flat.setdefault(_class_at(opt.owner, opt.path[:-1]), {})[opt.path[-1]] = name
    lines = []
    for config_class in (LoadOptions, EngineConfig, ReuseConfig, ChunkingConfig, RepairConfig, TierConfig,
                         KVQuantConfig, DecodeConfig, SamplingConfig):
        lines += _table(config_class, flat.get(config_class, {}))
    return "\n".join(lines)


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, reference())
