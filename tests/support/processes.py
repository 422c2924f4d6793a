"""What tests need to start the project in another process: the checkout's root, this folder (tests/support: tiny
models, the fake hub and RESP server, the redis fixture, the worker scripts) and an environment in which a child
Python finds both."""

from __future__ import annotations

import os
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
ROOT = SUPPORT.parents[1]


def child_env(**extra: str) -> dict:
    """os.environ with PYTHONPATH = the checkout's root and tests/support (the project's packages and these
    helpers import in a child as they do in the suite), plus `extra`."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(SUPPORT)]))
    env.update(extra)
    return env


def app_env(**extra: str) -> dict:
    """child_env for the desktop app: Qt offscreen."""
    return child_env(QT_QPA_PLATFORM="offscreen", **extra)


# `kvboost ARGS` (python -c NO_TORCH ARGS) that says at the end whether it imported torch: commands that load no
# model start without it.
NO_TORCH = """
import sys
from cli.kvboost import main
code = main(sys.argv[1:])
print("torch imported:", "torch" in sys.modules)
sys.exit(code)
"""
