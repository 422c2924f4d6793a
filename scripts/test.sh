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
export QT_QPA_PLATFORM=offscreen
# engine/ never imports Qt (contract in pyproject.toml).
.venv/bin/lint-imports
exec .venv/bin/python -m pytest "$@"
