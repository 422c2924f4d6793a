"""A hostile hub (tests/support/fake_hub.py on 127.0.0.1, answering what it likes): ETags, file names and commits
that are paths, links in the cache that point out of it, a redirect loop, an empty file, a full disk. Each is one
ModelHubError with a message that names the value, nothing is written outside the cache folder, and the command
line prints one line and exits 1."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fake_hub import FakeHub

from hub.models import DiskFull, ModelHub, ModelHubError, OutsideCache, RefusedHubAnswer

SMALL_REPO = "test-org/small-GGUF"
SMALL_NAME = "small.Q4_0.gguf"
BIG_REPO = "test-org/big-GGUF"
BIG_NAME = "big.Q4_0.gguf"
REPO_FOLDER = "models--test-org--small-GGUF"
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
EMPTY_GIT_SHA1 = hashlib.sha1(b"blob 0\0").hexdigest()
MB = 1 << 20


@pytest.fixture(scope="module")
def small_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("files") / "small"
    path.write_bytes(random.Random(0).randbytes(256 * 1024))
    return path


@pytest.fixture(scope="module")
def big_file(tmp_path_factory) -> Path:
    """3 MB: more than the 1 MB disk of the full-disk tests holds."""
    path = tmp_path_factory.mktemp("files") / "big"
    path.write_bytes(random.Random(1).randbytes(3 * MB))
    return path


@pytest.fixture
def hub(small_file, big_file):
    running = FakeHub()
    running.add_repo(SMALL_REPO, {SMALL_NAME: small_file}, tags=["gguf", "llama"], gguf={"architecture": "llama"})
    running.add_repo(BIG_REPO, {BIG_NAME: big_file}, tags=["gguf", "llama"], gguf={"architecture": "llama"})
    running.start()
    yield running
    running.stop()


@pytest.fixture
def cache(tmp_path) -> Path:
    return tmp_path / "hf-cache"


@pytest.fixture
def library(hub, cache):
    return ModelHub(endpoint=hub.url, cache_dir=cache, token=False)


def written_outside(root: Path, cache: Path, allowed=()) -> list[str]:
    """Every file, link and folder under `root` that is neither the cache folder, in it, nor in `allowed`."""
    found = []
    for folder, dirs, files in os.walk(root):  # links are listed, never entered
        for name in dirs + files:
            path = Path(folder) / name
            if not path.is_relative_to(cache) and path not in allowed:
                found.append(str(path.relative_to(root)))
        dirs[:] = [d for d in dirs if not (Path(folder) / d).is_relative_to(cache)]
    return sorted(found)


def looks_complete_files(cache: Path) -> list[Path]:
    """Snapshot entries and blobs without .incomplete: what anyone reading the cache takes as finished."""
    if not cache.exists():
        return []
    return [p for p in cache.rglob("*") if p.is_file() and ("snapshots" in p.parts or (
        "blobs" in p.parts and not p.name.endswith(".incomplete")))]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def mount_tmpfs(folder: Path, size: str) -> None:
    """A small real file system at `folder` (as tests/faults/test_disk_faults.py makes one); needs root."""
    folder.mkdir(parents=True)
    if os.system(f"mount -t tmpfs -o size={size} tmpfs '{folder}' 2>/dev/null") != 0:
        pytest.skip("needs mount (root) for a small file system")


@pytest.fixture
def small_disk(tmp_path):
    folder = tmp_path / "small-disk"
    mount_tmpfs(folder, "1m")
    yield folder
    os.system(f"umount -l '{folder}'")


# -- names from the hub that are paths ---------------------------------------------------------------------------
@pytest.mark.parametrize("etag", ['"../../../outside/x"', "absolute", 'W/"../../../outside/x"'])
def test_an_etag_that_is_a_path_is_refused_and_nothing_is_written_outside(hub, library, cache, tmp_path, etag):
    if etag == "absolute":
        etag = f'"{tmp_path / "outside" / "x"}"'
    hub.faults.etag[SMALL_NAME] = etag
    with pytest.raises(RefusedHubAnswer, match=r"ETag .*outside/x"):
        library.download(SMALL_REPO)
    assert written_outside(tmp_path, cache) == []
    assert looks_complete_files(cache) == []


@pytest.mark.parametrize("name", ["../../../../outside/x.gguf", "absolute", "a/../../../../../outside/x.gguf"])
def test_a_file_name_that_leaves_the_snapshot_is_refused_and_nothing_is_linked_outside(hub, library, cache,
                                                                                        tmp_path, small_file, name):
    if name == "absolute":
        name = str(tmp_path / "outside" / "x.gguf")
    hub.faults.rfilenames[SMALL_NAME] = name
    hub.faults.any_file = small_file  # the hub serves the file at whatever URL that name makes
    with pytest.raises(RefusedHubAnswer, match=r"rfilename.*outside/x\.gguf"):
        library.download(SMALL_REPO)
    assert written_outside(tmp_path, cache) == []


def test_a_commit_that_is_a_path_is_refused_and_no_snapshot_folder_is_made_outside(hub, library, cache, tmp_path):
    hub.faults.commit = "../../../outside/snapcommit"
    with pytest.raises(RefusedHubAnswer, match=r"commit .*outside/snapcommit"):
        library.download(SMALL_REPO)
    assert written_outside(tmp_path, cache) == []


@pytest.mark.parametrize("link", [f"{REPO_FOLDER}/blobs", f"{REPO_FOLDER}/snapshots", f"{REPO_FOLDER}/refs",
                                  ".locks", REPO_FOLDER])
def test_a_link_in_the_cache_that_points_out_of_it_is_not_written_through(library, cache, tmp_path, link):
    outside = tmp_path / "outside"
    outside.mkdir()
    (cache / link).parent.mkdir(parents=True, exist_ok=True)
    (cache / link).symlink_to(outside)
    with pytest.raises(OutsideCache, match="outside the cache"):
        library.download(SMALL_REPO)
    assert list(outside.iterdir()) == []


def test_remove_does_not_delete_through_a_link_out_of_the_cache(library, cache, tmp_path):
    library.download(SMALL_REPO)
    mine = tmp_path / "outside" / REPO_FOLDER / "keep.txt"
    mine.parent.mkdir(parents=True)
    mine.write_text("mine")
    shutil.rmtree(cache / ".locks")
    (cache / ".locks").symlink_to(tmp_path / "outside")
    with pytest.raises(OutsideCache, match="outside the cache"):
        library.remove(SMALL_REPO)
    assert mine.read_text() == "mine"


# -- answers that used to be tracebacks ---------------------------------------------------------------------------
@pytest.mark.parametrize("where", [SMALL_NAME, "api"])
def test_a_redirect_loop_is_one_clear_error(hub, library, cache, where):
    hub.faults.redirect_loop.add(where)
    with pytest.raises(ModelHubError, match="redirects in a loop"):
        library.download(SMALL_REPO)
    assert looks_complete_files(cache) == []


def test_an_empty_file_downloads_as_a_verified_blob_and_a_snapshot_link(hub, library, tmp_path, small_file):
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "llama"}')
    hub.add_repo("test-org/empty-GGUF", {"empty.Q4_0.gguf": empty}, tags=["gguf", "llama"],
                 gguf={"architecture": "llama"})
    hub.add_repo("test-org/with-empty-file", {"config.json": config, "model.safetensors": small_file,
                                              "empty.txt": empty},
                 tags=["safetensors", "llama"], config={"model_type": "llama"})

    gguf = library.download("test-org/empty-GGUF")  # an LFS file: named by its sha256
    assert gguf.is_symlink() and gguf.read_bytes() == b""
    assert gguf.resolve().name == EMPTY_SHA256 and gguf.resolve().parent.name == "blobs"
    folder = library.download("test-org/with-empty-file")  # any other file: named by its git blob sha1
    assert (folder / "empty.txt").is_symlink() and (folder / "empty.txt").read_bytes() == b""
    assert (folder / "empty.txt").resolve().name == EMPTY_GIT_SHA1
    assert sorted((m.repo, m.complete) for m in library.downloaded()) == [
        ("test-org/empty-GGUF", True), ("test-org/with-empty-file", True)]


def test_a_full_disk_is_one_clear_error_and_the_next_download_resumes(hub, small_disk, big_file):
    library = ModelHub(endpoint=hub.url, cache_dir=small_disk / "hf-cache", token=False)
    with pytest.raises(DiskFull, match="disk is full") as refused:
        library.download(BIG_REPO)
    assert "resume" in str(refused.value)
    (partial,) = (small_disk / "hf-cache").rglob("*.incomplete")
    held = partial.stat().st_size
    assert 0 < held <= MB and looks_complete_files(small_disk / "hf-cache") == []

    assert os.system(f"mount -o remount,size=8m '{small_disk}'") == 0  # room made: the same download resumes
    path = library.download(BIG_REPO)
    assert hub.ranged_gets(BIG_NAME)[-1] == f"bytes={held}-"
    assert sha256(path) == sha256(big_file)


# -- the command line ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hostile", ["etag", "redirect loop", "full disk"])
def test_the_cli_prints_one_error_line_for_a_hostile_hub(hub, tmp_path, hostile):
    home = tmp_path / "hf-home"
    repo, expected = SMALL_REPO, {"etag": "ETag", "redirect loop": "redirects in a loop", "full disk": "disk is full"}
    if hostile == "etag":
        hub.faults.etag[SMALL_NAME] = '"../../../outside/x"'
    elif hostile == "redirect loop":
        hub.faults.redirect_loop.add(SMALL_NAME)
    else:
        mount_tmpfs(home, "1m")
        repo = BIG_REPO
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(home), "HF_HUB_DISABLE_XET": "1"}
    env.pop("HF_HUB_CACHE", None)
    try:
        got = subprocess.run([sys.executable, "-m", "cli.kvboost", "models", "download", repo], capture_output=True,
                             text=True, env=env, timeout=300, cwd=Path(__file__).resolve().parents[2])
    finally:
        if hostile == "full disk":
            os.system(f"umount -l '{home}'")
    assert got.returncode == 1 and "Traceback" not in got.stderr, got.stderr
    errors = [line for line in got.stderr.splitlines() if line.startswith("kvboost models:")]
    assert len(errors) == 1 and errors[0] == got.stderr.strip().splitlines()[-1]
    assert errors[0].startswith("kvboost models: error:") and expected[hostile] in errors[0]
    assert written_outside(tmp_path, home / "hub", allowed=(home,)) == []
