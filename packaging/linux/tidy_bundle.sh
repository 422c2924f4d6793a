#!/usr/bin/env bash
# Does to a frozen bundle (packaging/linux/build.sh passes build/frozen/kvboost-desktop) what Debian does to its own
# binaries, before the tar.gz, the .deb and the AppDir are made from it:
# - shared libraries and programs inside _internal (torch_shm_manager) lose their symbol tables (--strip-unneeded
#   keeps what linking needs; libtorch_cpu.so alone shrinks by about 90 MB), unless stripping breaks them: libraries that auditwheel patched (numpy.libs/...) can
#   come out with a load segment the loader refuses ("ELF load command address/offset not page-aligned"), and
#   those are kept as they were;
# - RUNPATHs naming the build machine's folders (a pyenv or hosted-toolcache Python) go, $ORIGIN ones stay;
# - only programs and scripts keep an executable bit (libraries and the licence texts wheels ship do not).
# The bootloader executable is left alone: the app's Python archive is appended to it.
set -euo pipefail
bundle="$1"
test -d "$bundle/_internal"

loads_aligned() {  # every PT_LOAD segment of $1 has its address congruent to its file offset, as ld.so requires
    readelf -lW "$1" | awk '$1 == "LOAD" {print $2, $3, $NF}' | while read -r offset address align; do
        (( (address - offset) % align == 0 )) || exit 1
    done
}

num_stripped=0
kept_unstripped=()
while IFS= read -r -d '' lib; do
    info="$(file -b "$lib")"
    case "$info" in ELF*"shared object"* | ELF*executable*) ;; *) continue ;; esac
    if [[ "$info" == *"not stripped"* ]]; then
        cp -p "$lib" "$lib.unstripped"
        strip --strip-unneeded "$lib"
        if loads_aligned "$lib"; then
            rm "$lib.unstripped"
            num_stripped=$((num_stripped + 1))
        else
            mv "$lib.unstripped" "$lib"
            kept_unstripped+=("${lib#"$bundle/"}")
        fi
    fi
    runpath="$(patchelf --print-rpath "$lib")"
    if [ -n "$runpath" ]; then
        kept="$(tr ':' '\n' <<< "$runpath" | grep '^\$ORIGIN' | paste -sd: || true)"
        if [ "$kept" != "$runpath" ]; then
            if [ -n "$kept" ]; then patchelf --set-rpath "$kept" "$lib"; else patchelf --remove-rpath "$lib"; fi
        fi
    fi
    case "$info" in *"shared object"*) chmod a-x "$lib" ;; esac
done < <(find "$bundle/_internal" -type f \( -name '*.so' -o -name '*.so.*' -o -perm /111 \) -print0)
while IFS= read -r -d '' f; do
    case "$(file -b "$f")" in *executable*) ;; *) chmod a-x "$f" ;; esac
done < <(find "$bundle/_internal" -type f -perm /111 ! -name '*.so' ! -name '*.so.*' -print0)
echo "stripped $num_stripped libraries and programs; left unstripped (stripping would break them): ${kept_unstripped[*]:-none}"
