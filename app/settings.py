"""The app's settings, typed: what the settings table of the app's SQLite file holds, read through one migration.

`load(db)` reads every row into a `Settings` (frozen dataclasses, each field with its default); rows written by
an earlier version are migrated first (SETTINGS_MIGRATIONS, by the stored "schema_version"), and a value edited by
hand or broken is replaced by its default (logged), never passed on. `save(db, settings)` writes every row and the
schema version in one transaction; `update(db, **changes)` is load, replace, save.

The engine options the app keeps per model (reuse, weights, layer streaming, the shared KV store) take their
defaults and allowed values from the engine's own option fields (engine.config.options): they are not spelled out
here a second time. The shared KV store's URL is kept without its password (that lives in the OS keyring:
app.model_menu), the remote server's API key likewise.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from engine.config import options as engine_options

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2  # 1: the untyped rows of earlier versions (no "schema_version" row)
ROWS = ("model", "recent_models", "remote", "api_server", "theme", "text_size")  # the table's keys besides the version
RECENT_MAX = 8
THEMES = ("system", "light", "dark")  # app.theme applies them
TEXT_SIZES = range(-4, 9)  # steps of app.text_size from the system's font size


class SettingsError(ValueError):
    """The settings cannot be read by this version (written by a newer one); the message says so."""


def _engine_default(name: str):
    return field(default=engine_options()[name].default, metadata={"engine_option": name})


@dataclass(frozen=True)
class ModelChoice:
    """A model and the options it loads with: the model to load at start, and each recent model."""

    source: str | None = None  # a .gguf file, a model folder or a hub id; None: the built-in model
    reuse: str = _engine_default("reuse")
    weights: str = _engine_default("weights")
    layer_streaming: bool = _engine_default("layer_streaming")
    remote_cache: str | None = _engine_default("remote_cache")  # without its password

    def engine_options(self) -> dict:
        """The engine options this choice sets, by their names in engine.config.options (the source apart)."""
        return {f.metadata["engine_option"]: getattr(self, f.name) for f in dataclasses.fields(self)
                if "engine_option" in f.metadata}


@dataclass(frozen=True)
class RemoteServer:
    """An OpenAI-compatible server that answers instead of the engine (Model > Remote server…)."""

    base_url: str = "http://127.0.0.1:8000/v1"
    model: str = ""
    active: bool = False  # answers came from it when the app last chose


@dataclass(frozen=True)
class ApiServer:
    """The OpenAI-compatible API the app serves over its loaded model (Server > Serve the API)."""

    enabled: bool = False
    port: int = 8000


@dataclass(frozen=True)
class Settings:
    model: ModelChoice = field(default_factory=ModelChoice)
    recent_models: tuple[ModelChoice, ...] = ()  # newest first, at most RECENT_MAX
    remote: RemoteServer = field(default_factory=RemoteServer)
    api_server: ApiServer = field(default_factory=ApiServer)
    theme: str = "system"  # one of app.theme.THEMES
    text_size: int = 0  # View > Larger / Smaller text: steps in TEXT_SIZES

    def remembering(self, choice: ModelChoice) -> "Settings":
        """`choice` as the model to load at start and the newest recent one (an earlier entry of the same source and
        weights dropped)."""
        rest = [e for e in self.recent_models if (e.source, e.weights) != (choice.source, choice.weights)]
        return dataclasses.replace(self, model=choice, recent_models=tuple([choice, *rest][:RECENT_MAX]))


# -- reading: migrations, then each value checked against its field ---------------------------------------------

def _v1_to_v2(rows: dict) -> dict:
    """Version 1 kept the layer-streaming choice as "awq_streaming" in earlier releases (in the model row and in
    recent models); version 2 names it "layer_streaming"."""
    def renamed(entry):
        if not isinstance(entry, dict):
            return entry
        entry = dict(entry)
        old = entry.pop("awq_streaming", None)
        if old is not None and "layer_streaming" not in entry:
            entry["layer_streaming"] = bool(old)
        return entry

    rows = dict(rows)
    if "model" in rows:
        rows["model"] = renamed(rows["model"])
    if isinstance(rows.get("recent_models"), list):
        rows["recent_models"] = [renamed(e) for e in rows["recent_models"]]
    return rows


# SETTINGS_MIGRATIONS[i] takes the rows from version i + 1 to i + 2. Append only.
SETTINGS_MIGRATIONS: list[Callable[[dict], dict]] = [_v1_to_v2]


def _allowed(f: dataclasses.Field, value) -> bool:
    name = f.metadata.get("engine_option")
    if name is not None:
        choices = engine_options()[name].choices
        if choices is not None:
            return value in choices
    kind = str(f.type)
    if value is None:
        return "None" in kind
    if kind.startswith("bool"):
        return isinstance(value, bool)
    if kind.startswith("int"):
        return isinstance(value, int) and not isinstance(value, bool) and (f.name != "port" or 1 <= value <= 65535)
    if kind.startswith("str"):
        return isinstance(value, str)
    return False


def _typed(cls, stored, where: str):
    """`cls` from a stored dict: each known key whose value its field allows, defaults for the rest."""
    if not isinstance(stored, dict):
        if stored is not None:
            log.warning("settings: %s is not a table (%r); using the defaults", where, stored)
        return cls()
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in stored:
            continue
        if _allowed(f, stored[f.name]):
            values[f.name] = stored[f.name]
        else:
            log.warning("settings: %s.%s = %r is not allowed; using the default", where, f.name, stored[f.name])
    return cls(**values)


def from_rows(rows: dict[str, Any]) -> Settings:
    """Settings from the settings table's rows (key -> decoded JSON), migrated from their version first."""
    version = rows.get("schema_version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= SCHEMA_VERSION:
        raise SettingsError(f"the settings were written by a newer or unknown version (schema_version {version!r}); "
                         f"this version reads 1..{SCHEMA_VERSION}")
    for migrate in SETTINGS_MIGRATIONS[version - 1:]:
        rows = migrate(rows)
    recent = rows.get("recent_models")
    recent = recent if isinstance(recent, list) else []
    theme = rows.get("theme", "system")
    if theme not in THEMES:
        log.warning("settings: theme %r is not one of %s; using the default", theme, THEMES)
        theme = "system"
    text_size = rows.get("text_size", 0)
    if isinstance(text_size, bool) or text_size not in TEXT_SIZES:
        log.warning("settings: text_size %r is not one of %s..%s; using the default", text_size, TEXT_SIZES[0],
                    TEXT_SIZES[-1])
        text_size = 0
    return Settings(model=_typed(ModelChoice, rows.get("model"), "model"),
                    recent_models=tuple(_typed(ModelChoice, e, "recent_models")
                                        for e in recent[:RECENT_MAX] if isinstance(e, dict)),
                    remote=_typed(RemoteServer, rows.get("remote"), "remote"),
                    api_server=_typed(ApiServer, rows.get("api_server"), "api_server"), theme=theme,
                    text_size=text_size)


def to_rows(settings: Settings) -> dict[str, Any]:
    rows = {name: dataclasses.asdict(getattr(settings, name)) for name in ("model", "remote", "api_server")}
    rows["recent_models"] = [dataclasses.asdict(e) for e in settings.recent_models]
    rows["theme"] = settings.theme
    rows["text_size"] = settings.text_size
    rows["schema_version"] = SCHEMA_VERSION
    return rows


def load(db) -> Settings:
    """The settings of `db` (app.db.Database); a file of an earlier version is read through the migrations and
    written back in this version's form."""
    rows = {key: value for key in (*ROWS, "schema_version") if (value := db.get_setting(key)) is not None}
    settings = from_rows(rows)
    if rows and rows.get("schema_version") != SCHEMA_VERSION:
        save(db, settings)
    return settings


def save(db, settings: Settings) -> None:
    db.set_settings(to_rows(settings))


def update(db, **changes) -> Settings:
    """The settings with `changes` (fields of Settings) applied, saved."""
    settings = dataclasses.replace(load(db), **changes)
    save(db, settings)
    return settings
