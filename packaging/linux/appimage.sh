#!/usr/bin/env bash
# Packs build/AppDir (made by packaging/linux/build.sh) into dist/KVBoost_Desktop-VERSION-ARCH.AppImage.
# Needs appimagetool, which is not a Debian package; on a CI runner:
#   curl -fsSL -o appimagetool https://github.com/AppImage/appimagetool/releases/download/continuous/appimagetool-x86_64.AppImage
#   chmod +x appimagetool && APPIMAGETOOL=./appimagetool bash packaging/linux/appimage.sh
# (without FUSE, e.g. in a container: APPIMAGE_EXTRACT_AND_RUN=1). The AppImage uses the host's X11/xcb, GL, font and
# D-Bus libraries, like the .deb (see the spec's SYSTEM_LIBS); on a minimal system:
#   apt-get install libxcb-cursor0 libxcb-icccm4 libxcb-keysyms1 libxkbcommon-x11-0
set -euo pipefail
cd "$(dirname "$0")/../.."
tool="${APPIMAGETOOL:-appimagetool}"
command -v "$tool" >/dev/null || { echo "appimagetool not found (see the top of $0)" >&2; exit 2; }
test -x build/AppDir/AppRun || { echo "build/AppDir is missing: run packaging/linux/build.sh first" >&2; exit 2; }
version="$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')"
arch="$(uname -m)"
mkdir -p dist
ARCH="$arch" "$tool" --no-appstream build/AppDir "dist/KVBoost_Desktop-$version-$arch.AppImage"
ls -l dist/*.AppImage
