#!/usr/bin/env bash
# Tries the built .deb as a user would get it, on this machine (Debian/Ubuntu, as root; it installs and removes
# the package): installs dist/kvboost-desktop_*.deb with its Depends, runs the installed app's --self-test, starts
# it under Xvfb and waits for its window, saves a screenshot as dist/kvboost-desktop-xvfb.png, quits it with
# SIGTERM (as a logout would) and removes the package again. Exit status 0 when every step passed.
#   apt-get install xvfb x11-utils xdotool imagemagick
# SMOKE_SETTLE_S: seconds between the window showing and the screenshot (the model loads meanwhile; default 45).
set -euo pipefail
cd "$(dirname "$0")/../.."
name=kvboost-desktop
deb="$(ls -t dist/${name}_*.deb | sed -n 1p)"
work="$(mktemp -d)"
xvfb_pid=""
app_pid=""
step() { echo "== $*"; }
fail() { echo "smoke FAILED: $*" >&2; exit 1; }
cleanup() {
    [ -n "$app_pid" ] && kill "$app_pid" 2>/dev/null || true
    [ -n "$xvfb_pid" ] && kill "$xvfb_pid" 2>/dev/null || true
    if dpkg -s "$name" >/dev/null 2>&1; then
        apt-get remove --purge -y -qq "$name" >/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

step "install $deb"
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "./$deb" >/dev/null
command -v "$name" >/dev/null || fail "$name is not on PATH after installing"
test -f "/usr/share/applications/$name.desktop" || fail "no menu entry"
test -f "/usr/share/icons/hicolor/256x256/apps/$name.png" || fail "no icon"

step "self-test of the installed app (a fresh user: HOME=$work/user)"
mkdir -p "$work/user"
code=0
HOME="$work/user" "$name" --self-test --self-test-dir "$work/self-test" > "$work/self-test.out" \
    2> "$work/self-test.err" || code=$?
[ "$code" = 0 ] || { tail -20 "$work/self-test.err"; fail "--self-test exited $code"; }
grep "self-test ok" "$work/self-test.out" || fail "no result line: $(cat "$work/self-test.out")"
cp "$work/self-test/kvboost-self-test.png" "dist/$name-self-test.png"

step "the window under Xvfb"
display=":$((90 + RANDOM % 9))"
Xvfb "$display" -screen 0 1280x800x24 -nolisten tcp > "$work/xvfb.log" 2>&1 &
xvfb_pid=$!
for _ in $(seq 50); do xdpyinfo -display "$display" >/dev/null 2>&1 && break; sleep 0.2; done
mkdir -p "$work/user2"
started_ns=$(date +%s%N)
DISPLAY="$display" HOME="$work/user2" "$name" > "$work/app.out" 2>&1 &
app_pid=$!
window=""
for _ in $(seq 300); do
    window="$(DISPLAY="$display" xdotool search --onlyvisible --name "KVBoost" 2>/dev/null | head -1 || true)"
    [ -n "$window" ] && break
    kill -0 "$app_pid" 2>/dev/null || { cat "$work/app.out"; fail "the app exited before showing a window"; }
    sleep 0.2
done
[ -n "$window" ] || fail "no KVBoost window within 60 s"
echo "window $window mapped $(( ($(date +%s%N) - started_ns) / 1000000 )) ms after start (xwininfo):"
DISPLAY="$display" xwininfo -root -tree | grep -i "kvboost" | sed -n 1,3p
wm_class="$(DISPLAY="$display" xprop -id "$window" WM_CLASS)"
echo "$wm_class"
startup_class="$(sed -n 's/^StartupWMClass=//p' "/usr/share/applications/$name.desktop")"
grep -qF "\"$startup_class\"" <<< "$wm_class" || fail "the menu entry's StartupWMClass=$startup_class is not the window's"
icon="$(DISPLAY="$display" xprop -id "$window" _NET_WM_ICON)"
grep -q "^_NET_WM_ICON(CARDINAL) = " <<< "$icon" || fail "the window has no icon: $icon"
sleep "${SMOKE_SETTLE_S:-45}"
DISPLAY="$display" import -window root "dist/$name-xvfb.png"
echo "screenshot: dist/$name-xvfb.png"

step "quit (SIGTERM) and remove"
kill -TERM "$app_pid"
code=0
wait "$app_pid" || code=$?
app_pid=""
[ "$code" = 0 ] || { cat "$work/app.out"; fail "the app exited $code on SIGTERM"; }
apt-get remove --purge -y -qq "$name" >/dev/null
test ! -e "/opt/$name" || fail "/opt/$name is left after removing the package"
echo "smoke ok"
