"""The installed version of KVBoost Desktop (pyproject.toml's, the one place it is written), for --version."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path


def version() -> str:
    """The installed distribution's version; in a checkout or bundle without its metadata, pyproject.toml's
    beside the packages; "unknown" when neither can be read."""
    try:
        return importlib.metadata.version("kvboost-desktop")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return "unknown"
    found = re.search(r'^version = "([^"]+)"', text, re.M)
    return found.group(1) if found else "unknown"
