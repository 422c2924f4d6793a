#!/usr/bin/env bash
# Sets up .venv with the test tools and runs the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
# The shared KV tier's tests run a real redis-server (Debian's package): installed here when it is missing and
# this runs as root (CI), and a failed install stops the run; without root those tests skip and say why.
if ! command -v redis-server >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y -q redis-server >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null && apt-get install -y -q redis-server >/dev/null; } \
        || { echo "test.sh: redis-server could not be installed with apt-get" >&2; exit 1; }
fi
# llama.cpp, the independent reference of tests/engine/test_llama_cpp_reference.py, in a virtualenv of its own
# (torch and llama.cpp in one process crash): built once (~15 min from source), then reused. A failed build is
# said here and those tests skip saying why; KVBOOST_LLAMA_PYTHON set beforehand uses that Python instead.
if [ -z "${KVBOOST_LLAMA_PYTHON:-}" ]; then
    if ! .llama-venv/bin/python -c "import llama_cpp" >/dev/null 2>&1; then
        { "${PYTHON:-python3}" -m venv .llama-venv \
            && CMAKE_ARGS="-DGGML_NATIVE=OFF" .llama-venv/bin/python -m pip install -q "llama-cpp-python==0.3.36" numpy; } \
            >/dev/null 2>&1 || echo "test.sh: llama-cpp-python could not be built; the llama.cpp reference tests skip" >&2
    fi
    if .llama-venv/bin/python -c "import llama_cpp" >/dev/null 2>&1; then
        export KVBOOST_LLAMA_PYTHON="$PWD/.llama-venv/bin/python"
    fi
fi
export QT_QPA_PLATFORM=offscreen
# Lint and import order (ruff, configured in pyproject.toml), then the import contracts (engine/ never imports
# Qt, nothing imports bench/, ...: pyproject.toml).
.venv/bin/ruff check .
.venv/bin/lint-imports
# The documentation (docs/, MkDocs): built strictly, so a broken link or page fails here; the options reference is
# generated from engine/config.py while it builds.
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$(mktemp -d)"
exec .venv/bin/python -m pytest "$@"
