"""Where the app keeps its files: per-user data, log and cache folders.

The one documented override is the KVBOOST_HOME environment variable (or the `home` argument): when set,
all three folders live under it, which is what tests and portable (USB-stick) installs use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import platformdirs

APP_NAME = "KVBoost Desktop"
APP_AUTHOR = "KVBoost"
HOME_ENV_VAR = "KVBOOST_HOME"
DATABASE_FILENAME = "kvboost.sqlite3"


class FolderError(RuntimeError):
    """A folder the app needs cannot be created or used; the message names it."""


@dataclass(frozen=True)
class AppPaths:
    data_dir: Path  # the database and anything the user would be sad to lose
    log_dir: Path
    cache_dir: Path  # safe to delete at any time
    # The engine's disk KV tier: None for the engine's own per-user folder, which `kvboost-server` and the CLI
    # use too, so KV computed by one is served to the others; under a home folder, inside it.
    kv_cache_dir: Path | None = None

    @property
    def database(self) -> Path:
        return self.data_dir / DATABASE_FILENAME

    def ensure(self) -> AppPaths:
        """Create the three folders (and their parents) if missing; returns self for chaining.

        FolderError when one cannot be: a file in the way, no permission.
        """
        for role, folder in (("data", self.data_dir), ("log", self.log_dir), ("cache", self.cache_dir)):
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                in_the_way = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
                if in_the_way is not None:
                    raise FolderError(f"cannot use {folder} as the {role} folder: {in_the_way} is a file, "
                                      "not a folder") from exc
                raise FolderError(f"cannot create the {role} folder {folder}: {exc.strerror or exc}") from exc
        return self


def app_paths(home: str | Path | None = None) -> AppPaths:
    """The app's folders: under `home` (or $KVBOOST_HOME) when given, else the platform's per-user folders.

    Nothing is created here; call `ensure()` before writing.
    """
    if home is None:
        home = os.environ.get(HOME_ENV_VAR) or None
    if home:
        root = Path(home).expanduser()
        return AppPaths(data_dir=root / "data", log_dir=root / "logs", cache_dir=root / "cache",
                        kv_cache_dir=root / "cache" / "kv")
    return AppPaths(
        data_dir=Path(platformdirs.user_data_dir(APP_NAME, APP_AUTHOR)),
        log_dir=Path(platformdirs.user_log_dir(APP_NAME, APP_AUTHOR)),
        cache_dir=Path(platformdirs.user_cache_dir(APP_NAME, APP_AUTHOR)),
    )
