"""The documentation stays true to the code: the architecture page names every module of every package and no
module that is gone; the README stays a short quick start; every engine option carries its help (the options
page is generated from it)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from engine import config

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "engine/kv", "engine/weights", "hub", "cli", "server", "app", "bench")


def _architecture_entries() -> dict[str, set[str]]:
    """{package: the file names its bullet of docs/architecture.md mentions}."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    bullets = re.split(r"^- \*\*", text, flags=re.M)[1:]
    named = {}
    for bullet in bullets:
        package = bullet.split("/**", 1)[0]
        named[package] = set(re.findall(r"`([A-Za-z_0-9]+\.(?:py|c))`", bullet))
        named[package] |= set(re.findall(r"\(\+ `([A-Za-z_0-9]+\.c)`\)", bullet))
    return named


@pytest.mark.parametrize("package", PACKAGES)
def test_the_architecture_page_names_every_module_of_a_package_and_no_other(package):
    files = {p.name for p in (ROOT / package).iterdir()
             if p.suffix in (".py", ".c") and p.name != "__init__.py"}
    named = _architecture_entries().get(package, set())
    assert sorted(files - named) == [], f"modules of {package}/ missing from docs/architecture.md"
    assert sorted(named - files) == [], f"docs/architecture.md names modules {package}/ does not have"


def test_the_readme_is_a_short_quick_start():
    readme = (ROOT / "README.md").read_text().splitlines()
    assert len(readme) <= 200
    assert "bash scripts/run.sh" in readme and "bash scripts/test.sh" in readme


@pytest.mark.parametrize("config_class", [config.EngineConfig, config.ReuseConfig, config.TierConfig,
                                          config.DecodeConfig, config.ChunkingConfig, config.RepairConfig,
                                          config.KVQuantConfig, config.SamplingConfig])
def test_every_engine_option_carries_one_line_of_help(config_class):
    for f in dataclasses.fields(config_class):
        text = config.help_of(config_class, f.name)
        assert text and "\n" not in text, f"{config_class.__name__}.{f.name}"
