#!/usr/bin/env bash
# Sets up .venv with the test tools and runs the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
export QT_QPA_PLATFORM=offscreen
# engine/ never imports Qt (contract in pyproject.toml).
.venv/bin/lint-imports
exec .venv/bin/python -m pytest "$@"
