"""High-DPI screens: at 150% (a fractional scale, kept as it is, not rounded to 200%) the window draws at that
density, and the status bar's geometry checks and the keyboard and screen-reader checks hold as at 100%."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
def test_on_a_screen_at_150_percent_the_status_bar_and_the_keyboard_checks_hold():
    env = {**os.environ, "QT_SCREEN_SCALE_FACTORS": "1.5", "QT_QPA_PLATFORM": "offscreen"}  # a screen at 150%
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(HERE / "test_status_bar.py"), str(HERE / "test_keyboard.py")],
                          cwd=HERE.parents[1], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1]
