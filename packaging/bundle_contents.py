"""What the frozen bundle holds beyond what PyInstaller's import analysis finds, and what it leaves out.

Imported by packaging/kvboost-desktop.spec (and by tests/packaging), so it needs only the standard library and,
for model_families(), transformers. Never give packaging/ an __init__.py: it would hide the `packaging` library.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

# -- the model families ------------------------------------------------------------------------------------------
# transformers imports a model's code only when a checkpoint asks for it (its _LazyModule), so the freezer's import
# analysis never sees it. The bundle holds the families the engine accepts: the model types it re-rotates
# (engine/rope.py VERIFIED_MODEL_TYPES) and blends (engine/blend.py BLEND_MODEL_TYPES), read from the source so the
# list follows the engine, plus the families whose tokenizer classes those checkpoints name (GPT2Tokenizer for phi,
# starcoder2 and olmo2; GPTNeoXTokenizer and CodeGenTokenizer in older tokenizer_config.json files).
# NOTE: transformers 5.23's models/__init__.py imports every family under `if TYPE_CHECKING:`, which the freezer
# follows too, so today all of them come along (about 45 MB of Python); the list is what the bundle must hold
# whatever a later transformers does. Leaving the others out would need each kept family's own imports of other
# families (gemma3 -> siglip, ...) worked out first.
ENGINE_MODEL_TYPE_SETS = {"rope.py": "VERIFIED_MODEL_TYPES", "blend.py": "BLEND_MODEL_TYPES"}
TOKENIZER_FAMILIES = ("gpt2", "gpt_neox", "codegen")


def string_set(module: Path, name: str) -> set[str]:
    """The string literals of the module-level assignment `name = frozenset({...})` in `module`."""
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            found = {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
            if found:
                return found
    raise ValueError(f"{module}: no {name} = frozenset({{...}}); update ENGINE_MODEL_TYPE_SETS")


def engine_model_types(root: Path) -> set[str]:
    return set().union(*(string_set(root / "engine" / f, n) for f, n in ENGINE_MODEL_TYPE_SETS.items()))


def model_families(root: Path) -> list[str]:
    """transformers.models subpackages to bundle: a model type names its config, and the module can differ
    (gemma3_text lives in transformers.models.gemma3)."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    return sorted({model_type_to_module_name(t) for t in engine_model_types(root)} | set(TOKENIZER_FAMILIES))


def transformers_filter(families: list[str]):
    """For collect_submodules("transformers", filter=...): all of transformers but the model families the engine
    cannot run (hundreds of them)."""
    kept = ("transformers.models.auto", *(f"transformers.models.{f}" for f in families))

    def wanted(name: str) -> bool:
        if not name.startswith("transformers.models."):
            return True
        return any(name == k or name.startswith(k + ".") for k in kept)

    return wanted


# Distribution metadata that libraries read at run time (transformers' is_*_available checks, version guards):
# without it a present package counts as missing (gguf: "GGUF support needs the gguf package").
METADATA = ("transformers", "tokenizers", "huggingface-hub", "safetensors", "torch", "numpy", "tqdm", "regex",
            "requests", "filelock", "packaging", "pyyaml", "gguf", "accelerate", "jinja2", "psutil", "fsspec",
            "platformdirs", "sqlite-utils", "xxhash", "pypdf", "python-docx", "qasync", "fastapi", "starlette",
            "pydantic", "uvicorn", "sse-starlette")

# -- what stays out --------------------------------------------------------------------------------------------
# Linux: libraries that must match the system the app runs on come from that system (the .deb's Depends, computed
# by packaging/linux/build.sh) and are never copied from the build machine. Sonames without "lib" and ".so...".
SYSTEM_LIBS = (
    # X11 and xcb: the display server's; GL, EGL, DRM and Wayland: the graphics driver's.
    "X11", "X11-xcb", "Xau", "Xdmcp", "Xext", "Xrender", "Xi", "xcb", "xcb-*", "xkbcommon", "xkbcommon-x11",
    "EGL", "GL", "GLX", "GLdispatch", "OpenGL", "drm", "gbm", "wayland-*",
    # Fonts and text shaping: the distribution's font configuration.
    "fontconfig", "freetype", "harfbuzz", "graphite2", "png16", "expat", "brotlidec", "brotlicommon",
    # The desktop session: D-Bus, GLib, Kerberos (Qt Network's Negotiate authentication) and what they pull in.
    "dbus-1", "glib-2.0", "gthread-2.0", "gobject-2.0", "gio-2.0", "gmodule-2.0", "mount", "blkid", "selinux",
    "pcre2-8", "systemd", "gcrypt", "gpg-error", "cap", "bsd", "md", "gssapi_krb5", "krb5", "krb5support",
    "k5crypto", "com_err", "keyutils",
    # The C++ runtime: the system's GL drivers need it at least as new as they were built with.
    "stdc++", "gcc_s",
    # GTK's stack, wanted only by the GTK platform theme left out below.
    "atk-1.0", "cairo", "cairo-gobject", "pango-1.0", "pangocairo-1.0", "pangoft2-1.0", "gdk_pixbuf-2.0",
    "pixman-1", "fribidi", "thai", "datrie", "jpeg",
)
SYSTEM_LIB = re.compile(r"^lib(%s)\.so(\..*)?$" % "|".join(re.escape(n).replace(r"\*", "[a-z0-9-]+")
                                                         for n in SYSTEM_LIBS))
# Qt plugins a desktop does not use: eglfs, linuxfb, vnc and vkkhrdisplay are for kiosks and embedded boards; the
# GTK theme would load the system's GTK 3 into the process (the XDG portal theme gives native dialogs instead).
UNUSED_QT_PLUGINS = re.compile(r"plugins/(platforms/libq(eglfs|linuxfb|vnc|vkkhrdisplay|minimalegl)\.so|"
                               r"egldeviceintegrations/|platformthemes/libqgtk3\.so)")
# A CUDA toolkit on the build machine (found through torch's ctypes look-ups): never part of the bundle; a CUDA
# build brings its libraries as nvidia-* wheels in the build venv.
HOST_CUDA = re.compile(r"^/(usr|opt)/(local/)?cuda[^/]*/")
# torch's wheel carries its C++ test programs and protoc (torch/bin, torch/test: about 130 MB); of torch/bin only
# torch_shm_manager is used at run time (sharing tensors between processes).
TORCH_TESTS = re.compile(r"^torch/(test/|bin/(?!torch_shm_manager(\.exe)?$))")


def kept_binary(dest: str, src: str, platform: str) -> bool:
    """Whether a binary PyInstaller found goes into the bundle: `dest` its path in the bundle, `src` where it was
    found, `platform` sys.platform of the build."""
    dest = dest.replace("\\", "/")
    if TORCH_TESTS.match(dest):
        return False
    if not platform.startswith("linux"):
        return True
    return not (SYSTEM_LIB.match(Path(dest).name) or UNUSED_QT_PLUGINS.search(dest) or HOST_CUDA.match(src or ""))


def kept_data(dest: str) -> bool:
    return not TORCH_TESTS.match(dest.replace("\\", "/"))
