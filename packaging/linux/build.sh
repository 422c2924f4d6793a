#!/usr/bin/env bash
# Builds the Linux installers of KVBoost Desktop into dist/:
#   dist/kvboost-desktop-VERSION-linux-ARCH.tar.gz   the PyInstaller folder; unpack anywhere, run ./kvboost-desktop
#   dist/kvboost-desktop_VERSION_DEBARCH.deb          /opt/kvboost-desktop, /usr/bin/kvboost-desktop, menu entry, icons
#   build/AppDir                                      packed into an .AppImage by packaging/linux/appimage.sh
# The bundle is frozen from build/venv (packaging/venv.sh: the pinned versions, torch CPU by default; TORCH_SPEC and
# TORCH_INDEX pick a CUDA wheel, see docs/guide/installers.md). Needs: python3 with a shared libpython, dpkg-deb and
# dpkg-shlibdeps (dpkg-dev), strip and patchelf, and the Qt xcb libraries installed (the Depends are read from them):
#   apt-get install dpkg-dev binutils patchelf file libxcb-cursor0 libxcb-icccm4 libxcb-keysyms1 libxkbcommon-x11-0 libegl1 libgl1 \
#       libfontconfig1 libdbus-1-3 libwayland-cursor0 libwayland-egl1
# DEB_MAINTAINER sets the package's Maintainer field.
set -euo pipefail
cd "$(dirname "$0")/../.."
here=packaging/linux

bash packaging/venv.sh
py=build/venv/bin/python
version="$("$py" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')"
# A CUDA build (TORCH_SPEC=torch==...+cuNNN) is named apart: "-cuda" in the tar.gz, "+cuda" in the .deb's version.
case "${TORCH_SPEC:-}" in *+cu*) variant=cuda ;; *) variant="" ;; esac
deb_version="$version${variant:++$variant}"
arch="$(uname -m)"
debarch="$(dpkg --print-architecture)"
name=kvboost-desktop
frozen="build/frozen/$name"
maintainer="${DEB_MAINTAINER:-KVBoost Desktop developers <kvboost-desktop@users.noreply.github.com>}"
built="$(date -R -u -d "@${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct)}")"

echo "== freezing (PyInstaller; the first build takes long, later ones reuse build/pyinstaller)"
rm -rf "$frozen"
nice -n 10 "$py" -m PyInstaller --noconfirm --log-level WARN --distpath build/frozen --workpath build/pyinstaller \
    packaging/kvboost-desktop.spec
test -x "$frozen/$name"
mkdir -p dist

echo "== tidying the bundle"
bash "$here/tidy_bundle.sh" "$frozen"

# Copies of the frozen folder share its files (hard links): the bundle is over a gigabyte.
place_bundle() {
    rm -rf "$1"
    mkdir -p "$(dirname "$1")"
    cp -al "$frozen" "$1"
}

echo "== tar.gz"
tarball="dist/$name-$version-linux-$arch${variant:+-$variant}.tar.gz"
tar --owner=0 --group=0 --numeric-owner -C build/frozen --transform "s,^$name,$name-$version," \
    -czf "$tarball" "$name"

echo "== .deb"
root="build/deb/$name"
rm -rf build/deb
place_bundle "$root/opt/$name"
install -d "$root/usr/bin" "$root/usr/share/applications" "$root/usr/share/doc/$name" "$root/usr/share/man/man1"
# The bootloader finds its _internal folder from /proc/self/exe, so a link is enough.
ln -s "/opt/$name/$name" "$root/usr/bin/$name"
install -m 644 "resources/$name.desktop" "$root/usr/share/applications/$name.desktop"
for png in resources/icons/kvboost-*.png; do
    size="${png##*-}"; size="${size%.png}"
    install -D -m 644 "$png" "$root/usr/share/icons/hicolor/${size}x${size}/apps/$name.png"
done
install -D -m 644 resources/icons/kvboost.svg "$root/usr/share/icons/hicolor/scalable/apps/$name.svg"
install -m 644 "$here/copyright" "$root/usr/share/doc/$name/copyright"
gzip -9n -c "$here/$name.1" > "$root/usr/share/man/man1/$name.1.gz"
{
    echo "$name ($deb_version) unstable; urgency=medium"
    echo
    echo "  * Release $version, built from the source tree (see the project's git history)."
    echo
    echo " -- $maintainer  $built"
} | gzip -9n > "$root/usr/share/doc/$name/changelog.gz"
install -D -m 644 "$here/lintian-overrides" "$root/usr/share/lintian/overrides/$name"
# Modes as Debian wants them: folders and executables 0755, everything else 0644.
find "$root" -type d -exec chmod 0755 {} +
find "$root" -type f -exec chmod u+rw,go-w,go+r {} +
find "$root" -type f -perm /111 -exec chmod 0755 {} +
find "$root" -type f ! -perm /111 -exec chmod 0644 {} +

# Depends: what the bundle's ELF files link against outside the bundle, with the versions their symbols need
# (dpkg-shlibdeps reads the system's shlibs/symbols files). Libraries inside the bundle are private (-l...).
shlib_work=build/deb/shlibdeps
mkdir -p "$shlib_work/debian" "$root/DEBIAN"  # DEBIAN/ marks the package root, where $ORIGIN rpaths resolve
printf 'Source: %s\n\nPackage: %s\nArchitecture: any\n' "$name" "$name" > "$shlib_work/debian/control"
mapfile -t elves < <(find "$PWD/$root/opt" -type f \( -name '*.so*' -o -perm /111 \) -exec sh -c \
    'head -c 4 "$1" | grep -q "ELF" && echo "$1"' _ {} \;)
# -l takes folders as installed (/opt/...), under the package root that DEBIAN/ marks.
mapfile -t private_dirs < <(printf '%s\n' "${elves[@]}" | xargs -n1 dirname | sort -u | sed "s,^$PWD/$root,-l,")
depends="$(cd "$shlib_work" && dpkg-shlibdeps -O --ignore-missing-info --warnings=0 "${private_dirs[@]}" \
    "${elves[@]}" | sed -n 's/^shlibs:Depends=//p')"
test -n "$depends"
installed_kb="$(du -sk --apparent-size "$root" | cut -f1)"
cat > "$root/DEBIAN/control" <<EOF
Package: $name
Version: $deb_version
Architecture: $debarch
Maintainer: $maintainer
Installed-Size: $installed_kb
Depends: $depends
Section: utils
Priority: optional
Description: private chat over your documents with a local language model
 KVBoost Desktop is a chat window for a language model that runs on this
 computer: nothing is sent anywhere. Documents (text, Markdown, PDF, DOCX)
 can be added to a conversation, and text already read once is kept as
 computed attention state and served again instead of being computed a
 second time, on disk across restarts.
 .
 A small model (SmolLM2-135M-Instruct) comes with the package, so the first
 start needs no network; larger models can be chosen from a model folder or
 a GGUF file. An OpenAI-compatible API for other programs can be switched on.
EOF
(cd "$root" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | sort -z | xargs -0 md5sum) \
    > "$root/DEBIAN/md5sums"
chmod 0644 "$root/DEBIAN/control" "$root/DEBIAN/md5sums"
deb="dist/${name}_${deb_version}_${debarch}.deb"
nice -n 10 dpkg-deb --root-owner-group -Z"${DEB_COMPRESSION:-xz}" --build "$root" "$deb"

echo "== AppDir"
appdir=build/AppDir
place_bundle "$appdir/usr/lib/$name"
install -m 755 "$here/AppRun" "$appdir/AppRun"
install -m 644 "resources/$name.desktop" "$appdir/$name.desktop"
install -m 644 resources/icons/kvboost-256.png "$appdir/$name.png"
ln -sf "$name.png" "$appdir/.DirIcon"
for png in resources/icons/kvboost-*.png; do
    size="${png##*-}"; size="${size%.png}"
    install -D -m 644 "$png" "$appdir/usr/share/icons/hicolor/${size}x${size}/apps/$name.png"
done
install -D -m 644 "resources/$name.desktop" "$appdir/usr/share/applications/$name.desktop"

echo "== done"
du -sh "$frozen" | sed 's/^/onedir  /'
ls -l "$tarball" "$deb" | awk '{printf "%s  %.0f MB\n", $NF, $5 / 1e6}'
echo "Depends: $depends"
