"""Front ends share the engine's one job type: engine.worker.Job is what the app and the server queue, and
neither defines a job class of its own (three did: the worker's, the app's payload dict with a string kind, the
server's asyncio bridge)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def job_classes(package: str) -> list[str]:
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and "job" in node.name.lower():
                found.append(f"{path.relative_to(ROOT).as_posix()}:{node.name}")
    return found


def test_only_the_engine_worker_defines_a_job_type():
    assert job_classes("engine") == ["engine/worker.py:Job"]
    assert job_classes("app") == [] and job_classes("server") == []


def test_the_server_queues_the_engine_workers_jobs():
    from engine.worker import Job
    from server import app as server_app

    assert server_app.Job is Job
