#!/usr/bin/env bash
# Sets up .venv and starts KVBoost Desktop: the window where a display exists, the terminal chat otherwise.
# Extra arguments go to the program (`kvboost-desktop --help`, `kvboost chat --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
case "$(uname -s)" in
    Darwin|MINGW*|MSYS*|CYGWIN*) has_display=1 ;;
    *) if [ -n "${DISPLAY:-}${WAYLAND_DISPLAY:-}" ]; then has_display=1; else has_display=0; fi ;;
esac
if [ "$has_display" = 1 ] && [ "${KVBOOST_CLI:-0}" != 1 ]; then
    # Where the window cannot open (a missing X11 library: it says which, and how to install it), the terminal
    # chat starts instead of a crash.
    if .venv/bin/kvboost-desktop --check-window >/dev/null; then
        exec .venv/bin/kvboost-desktop "$@"
    fi
    echo "Starting the terminal chat instead (KVBOOST_CLI=1 always does)." >&2
else
    echo "No display found: starting the terminal chat (the desktop app needs a display; KVBOOST_CLI=1 forces this)." >&2
fi
exec .venv/bin/kvboost chat "$@"
