#!/usr/bin/env bash
# Builds dist/KVBoost_Desktop-VERSION-macos-ARCH.dmg on a Mac (a CI runner): the .app from the spec's BUNDLE,
# checked with --self-test, signed, put in a disk image, notarized and stapled.
# Signing and notarizing happen when these are set (unsigned otherwise: fine for trying, Gatekeeper will warn):
#   CODESIGN_IDENTITY  "Developer ID Application: NAME (TEAMID)", in the keychain
#   NOTARY_PROFILE     a profile saved with `xcrun notarytool store-credentials NAME --apple-id ... --team-id ...`
# torch on macOS is the PyPI wheel (CPU and Apple's MPS; there is no CUDA on macOS).
set -euo pipefail
cd "$(dirname "$0")/../.."
bash packaging/venv.sh
py=build/venv/bin/python
version="$("$py" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')"
app="build/frozen/KVBoost Desktop.app"
dmg="dist/KVBoost_Desktop-$version-macos-$(uname -m).dmg"

"$py" -m PyInstaller --noconfirm --log-level WARN --distpath build/frozen --workpath build/pyinstaller \
    packaging/kvboost-desktop.spec
"$app/Contents/MacOS/kvboost-desktop" --self-test --self-test-dir build/self-test

if [ -n "${CODESIGN_IDENTITY:-}" ]; then
    sign() { codesign --force --timestamp --options runtime --sign "$CODESIGN_IDENTITY" "$@"; }
    # Inside out: every library and executable first, the app last (with the entitlements the hardened
    # runtime needs for Python, see entitlements.plist).
    find "$app/Contents" -type f \( -name '*.dylib' -o -name '*.so' -o -perm -u+x \) -print0 |
        while IFS= read -r -d '' f; do file -b "$f" | grep -q Mach-O && sign "$f"; done
    sign --entitlements packaging/macos/entitlements.plist "$app"
    codesign --verify --deep --strict --verbose=2 "$app"
fi

rm -rf build/dmg "$dmg"
mkdir -p build/dmg dist
cp -R "$app" build/dmg/
ln -s /Applications build/dmg/Applications
hdiutil create -volname "KVBoost Desktop" -srcfolder build/dmg -ov -format UDZO "$dmg"

if [ -n "${CODESIGN_IDENTITY:-}" ]; then
    codesign --force --timestamp --sign "$CODESIGN_IDENTITY" "$dmg"
    if [ -n "${NOTARY_PROFILE:-}" ]; then
        xcrun notarytool submit "$dmg" --keychain-profile "$NOTARY_PROFILE" --wait
        xcrun stapler staple "$dmg"
        spctl --assess --type open --context context:primary-signature --verbose "$dmg"
    fi
fi
ls -l "$dmg"
