#!/usr/bin/env bash
# Sets up .venv and starts an interactive chat with the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/kvboost chat "$@"
