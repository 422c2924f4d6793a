"""The mutation run (scripts/mutate.py) still describes the sources: every mutation's original snippet occurs
exactly once in its file, changes something, and names test files that exist. The run itself is not part of the
suite (it takes about half an hour); this cheap check catches the list drifting from the code."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def load_script():
    spec = importlib.util.spec_from_file_location("mutate", REPO / "scripts" / "mutate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("mutate", module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_mutation_still_applies_to_the_sources_exactly_once():
    mutate = load_script()
    assert len(mutate.MUTATIONS) >= 20
    assert mutate.check_applies(REPO) == []


def test_a_snippet_that_drifted_from_its_file_is_reported(tmp_path):
    mutate = load_script()
    first = mutate.MUTATIONS[0]
    (tmp_path / first.file).parent.mkdir(parents=True)
    (tmp_path / first.file).write_text(first.original + "\n" + first.original)
    problems = mutate.check_applies(tmp_path)
    assert f"{first.name}: the original occurs 2 times in {first.file}" in problems
    assert any(p.endswith("is gone") for p in problems)  # the other files and the tests are not in tmp_path
