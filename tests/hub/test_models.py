"""The model library (hub.models, hub.hub_cache, hub.model_fit, kvboost models) over a fake hub of our
own on 127.0.0.1 (tests/support/fake_hub.py) serving the embedded GGUF and a tiny safetensors llama built here.
Every cache folder is the test's own."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fake_hub import FakeHub
from tiny_models import build_model, build_tokenizer

from engine.weights import loader
from hub import model_fit
from hub.models import (
    DownloadCancelled,
    HashMismatch,
    HubNotFound,
    HubUnreachable,
    ModelHub,
    gguf_quant,
)

GGUF_REPO = "test-org/SmolLM2-135M-Instruct-GGUF"
TINY_REPO = "test-org/tiny-llama"
BERT_REPO = "test-org/tiny-bert"
GGUF = loader.default_model_path()
MB = 1 << 20


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


GGUF_SHA = sha256(GGUF)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    build_model("llama").save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    return folder


def serve(hub: FakeHub, tiny_folder: Path) -> FakeHub:
    hub.add_repo(GGUF_REPO, {GGUF.name: GGUF}, tags=["gguf", "llama", "text-generation"], downloads=50,
                 gguf={"architecture": "llama", "total": 134515008, "context_length": 8192})
    hub.add_repo(TINY_REPO, {p.name: p for p in sorted(tiny_folder.iterdir())},
                 tags=["safetensors", "llama", "text-generation"], downloads=20,
                 config={"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
                 safetensors={"parameters": {"F32": 100_000}, "total": 100_000})
    hub.add_repo(BERT_REPO, {"config.json": tiny_folder / "config.json"}, tags=["safetensors", "bert"],
                 config={"model_type": "bert"})
    return hub.start()


@pytest.fixture
def hub(tiny_folder):
    running = serve(FakeHub(), tiny_folder)
    yield running
    running.stop()


@pytest.fixture
def library(hub, tmp_path):
    return ModelHub(endpoint=hub.url, cache_dir=tmp_path / "hf-cache", token=False)


def complete(library) -> list:
    return [m for m in library.downloaded() if m.complete]


def looks_complete_files(cache: Path) -> list[Path]:
    """Files anyone reading the cache would take as finished: snapshot entries and blobs without .incomplete."""
    if not cache.exists():
        return []
    return [p for p in cache.rglob("*") if p.is_file() and ("snapshots" in p.parts or (
        "blobs" in p.parts and not p.name.endswith(".incomplete")))]


# -- search and listing --------------------------------------------------------------------------------------
def test_search_finds_both_models_and_drops_what_the_engine_cannot_run(library):
    gguf = library.search("smollm2")
    assert [(r.repo, r.architecture, r.formats, r.supported) for r in gguf] == [
        (GGUF_REPO, "llama", ("gguf",), True)]
    assert gguf[0].parameters == 134515008
    assert [r.repo for r in library.search("test-org")] == [GGUF_REPO, TINY_REPO]
    assert [r.repo for r in library.search("test-org", format="safetensors")] == [TINY_REPO]
    everything = {r.repo: r for r in library.search("test-org", supported_only=False)}
    assert not everything[BERT_REPO].supported and "'bert'" in everything[BERT_REPO].reason


@pytest.mark.parametrize("name, quant", [
    ("SmolLM2-135M-Instruct.Q4_1.gguf", "Q4_1"), ("qwen2.5-0.5b-instruct-q4_k_m.gguf", "Q4_K_M"),
    ("Llama-3.2-1B-Instruct-UD-Q4_K_XL.gguf", "Q4_K_XL"), ("model-IQ4_XS.gguf", "IQ4_XS"),
    ("Q8_0/model-Q8_0-00002-of-00003.gguf", "Q8_0"), ("phi-3-mini-f16.gguf", "F16"), ("weights.gguf", "weights"),
])
def test_gguf_quantization_is_read_from_the_file_name(name, quant):
    assert gguf_quant(name) == quant


def test_files_group_gguf_per_quantization_and_a_folder_as_one_entry(hub, library, tiny_folder):
    hub.add_repo("test-org/many", {"m.Q4_1.gguf": GGUF, "m-q8_0.gguf": tiny_folder / "model.safetensors",
                                   "m-Q2_K-00001-of-00002.gguf": tiny_folder / "config.json",
                                   "m-Q2_K-00002-of-00002.gguf": tiny_folder / "tokenizer.json",
                                   "mmproj-m-f16.gguf": tiny_folder / "config.json", "README.md": GGUF},
                 tags=["gguf", "llama"])
    entries = {e.name: e for e in library.files("test-org/many").entries}
    assert set(entries) == {"Q4_1", "Q8_0", "Q2_K"}
    assert entries["Q4_1"].size == GGUF.stat().st_size and entries["Q4_1"].supported
    split = entries["Q2_K"]
    assert [f.path for f in split.files] == ["m-Q2_K-00001-of-00002.gguf", "m-Q2_K-00002-of-00002.gguf"]
    assert not split.supported and "split" in split.note

    listing = library.files(TINY_REPO)
    (folder,) = listing.entries
    on_disk = {p.name: p.stat().st_size for p in tiny_folder.iterdir()}
    assert (folder.name, folder.format, folder.size) == ("safetensors", "safetensors", sum(on_disk.values()))
    assert folder.files[-1].path == "config.json"  # linked last: a folder without it is unfinished
    assert len(listing.revision) == 40 and listing.architecture == "llama"


# -- downloads ----------------------------------------------------------------------------------------------
def test_download_reports_progress_and_ends_byte_identical_and_loadable(library):
    seen = []
    path = library.download(GGUF_REPO, progress=lambda done, total: seen.append((done, total)))
    size = GGUF.stat().st_size
    assert sha256(path) == GGUF_SHA and path.name == GGUF.name and path.is_symlink()
    assert seen[-1] == (size, size) and len(seen) > 10
    assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))
    (model,) = complete(library)
    assert (model.repo, model.format, model.path, model.size_bytes) == (GGUF_REPO, "gguf", path, size)
    source = loader.resolve_source(path)  # what --model PATH takes: the snapshot's folder, not blobs/
    assert (Path(source.location) / source.gguf_file).is_file()
    assert (library.cache_dir / f"models--{GGUF_REPO.replace('/', '--')}" / "refs" / "main").read_text() == \
        model.revision


def test_a_dropped_connection_resumes_with_a_range_and_ends_byte_identical(hub, library):
    hub.faults.drop_after[GGUF.name] = 30 * MB + 123
    path = library.download(GGUF_REPO, "Q4_1")
    ranges = hub.ranged_gets(GGUF.name)
    assert ranges[0] is None and len(ranges) == 2
    resumed_at = int(ranges[1].removeprefix("bytes=").rstrip("-"))
    assert 0 < resumed_at <= 30 * MB + 123
    assert sha256(path) == GGUF_SHA


def test_a_wrong_hash_is_refused_and_nothing_looks_complete(hub, library):
    hub.faults.wrong_hash.add(GGUF.name)
    with pytest.raises(HashMismatch, match="hash"):
        library.download(GGUF_REPO)
    assert looks_complete_files(library.cache_dir) == []
    assert library.downloaded() == []  # the partial file went with the mismatch


def test_404_and_a_killed_server_are_clear_errors_and_downloads_stay_listed(hub, library):
    with pytest.raises(HubNotFound, match="not found on http://127.0.0.1"):
        library.files("test-org/no-such-model")
    hub.faults.missing.add(GGUF.name)
    with pytest.raises(HubNotFound, match=GGUF.name):
        library.download(GGUF_REPO)
    assert looks_complete_files(library.cache_dir) == []
    hub.faults.missing.clear()
    path = library.download(GGUF_REPO)
    hub.stop()
    for call in (lambda: library.search("smollm2"), lambda: library.files(GGUF_REPO),
                 lambda: library.download(GGUF_REPO)):
        with pytest.raises(HubUnreachable, match="cannot reach http://127.0.0.1"):
            call()
    assert [m.path for m in complete(library)] == [path]


def test_offline_mode_is_a_clear_error_without_asking_the_hub(hub, library, monkeypatch):
    library.download(GGUF_REPO)
    asked = len(hub.requests)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubUnreachable, match="HF_HUB_OFFLINE"):
        library.search("smollm2")
    assert len(hub.requests) == asked
    assert len(complete(library)) == 1


def test_cancel_leaves_nothing_complete_and_a_later_download_resumes(hub, library):
    cancel = threading.Event()

    def progress(done, total):
        if done >= 20 * MB:
            cancel.set()

    with pytest.raises(DownloadCancelled):
        library.download(GGUF_REPO, progress=progress, cancel=cancel)
    assert looks_complete_files(library.cache_dir) == []
    (partial,) = library.downloaded()
    assert not partial.complete and partial.format == "partial" and partial.size_bytes >= 20 * MB

    seen = []
    path = ModelHub(endpoint=hub.url, cache_dir=library.cache_dir, token=False).download(
        GGUF_REPO, progress=lambda done, total: seen.append(done))  # a new library: as after a restart
    assert hub.ranged_gets(GGUF.name)[-1] == f"bytes={partial.size_bytes}-"
    assert seen[0] == partial.size_bytes
    assert sha256(path) == GGUF_SHA
    assert [m.complete for m in library.downloaded()] == [True]


def test_a_hub_killed_mid_file_keeps_the_partial_and_the_restarted_hub_resumes(hub, library, tiny_folder):
    hub.faults.seconds_per_chunk = 0.002  # ~30 MB/s: the kill lands mid-file
    failure = []

    def run():
        try:
            library.download(GGUF_REPO)
        except Exception as exc:
            failure.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    partial = library.cache_dir / f"models--{GGUF_REPO.replace('/', '--')}" / "blobs" / f"{GGUF_SHA}.incomplete"
    deadline = time.monotonic() + 30
    while not (partial.exists() and partial.stat().st_size > 5 * MB):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    port = int(hub.url.rsplit(":", 1)[1])
    hub.stop()
    worker.join(60)
    assert isinstance(failure[0], HubUnreachable) and "resumes" in str(failure[0])
    assert looks_complete_files(library.cache_dir) == [] and partial.stat().st_size < GGUF.stat().st_size
    held = partial.stat().st_size

    restarted = serve(FakeHub(port=port), tiny_folder)
    try:
        path = library.download(GGUF_REPO)
        assert restarted.ranged_gets(GGUF.name) == [f"bytes={held}-"]
        assert sha256(path) == GGUF_SHA
    finally:
        restarted.stop()


def test_the_safetensors_folder_downloads_whole_and_loads(hub, library, tiny_folder):
    from engine import KVBoost

    hub.faults.missing.add("config.json")  # everything else arrives, then the last file fails
    with pytest.raises(HubNotFound):
        library.download(TINY_REPO)
    (unfinished,) = library.downloaded()
    assert (unfinished.format, unfinished.complete) == ("safetensors", False)

    hub.faults.missing.clear()
    folder = library.download(TINY_REPO)
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in tiny_folder.iterdir())
    assert all(sha256(folder / p.name) == sha256(p) for p in tiny_folder.iterdir())
    (model,) = library.downloaded()
    assert (model.format, model.complete, model.path) == ("safetensors", True, folder)
    engine = KVBoost.from_pretrained(str(folder), device="cpu", disk_cache_bytes=0)
    expected = build_model("llama").state_dict()
    assert all(engine.model.state_dict()[k].equal(v) for k, v in expected.items())


def test_remove_deletes_the_repo_and_frees_its_bytes(library):
    library.download(GGUF_REPO)
    freed = library.remove(GGUF_REPO)
    assert GGUF.stat().st_size <= freed < GGUF.stat().st_size + 4096  # the blob, and refs/main
    assert library.downloaded() == [] and looks_complete_files(library.cache_dir) == []


@pytest.mark.slow
def test_the_downloaded_gguf_loads_and_answers_paris(library):
    from engine import KVBoost

    path = library.download(GGUF_REPO)
    engine = KVBoost.from_pretrained(str(path), device="cpu", disk_cache_bytes=0)
    answer = engine.chat([{"role": "user", "content": "What is the capital of France?"}], max_new_tokens=12)
    assert "Paris" in answer.text


# -- fits ----------------------------------------------------------------------------------------------------
def test_the_gguf_header_matches_gguf_s_own_reader():
    from gguf import GGUFReader

    header = model_fit.read_gguf_file_header(GGUF)
    reader = GGUFReader(GGUF)
    meta = header["metadata"]
    for key in ("llama.block_count", "llama.attention.head_count", "llama.attention.head_count_kv",
                "llama.embedding_length"):
        assert meta[key] == int(reader.fields[key].parts[-1][0])
    assert header["num_params"] == sum(int(t.n_elements) for t in reader.tensors)
    assert header["layer_params"] == sum(int(t.n_elements) for t in reader.tensors if t.name.startswith("blk."))
    with pytest.raises(ValueError, match="past the"):
        model_fit.read_gguf_header(GGUF.read_bytes()[:100_000])


def test_fit_counts_weights_in_the_held_format_and_kv_per_token(library, tiny_folder):
    listing = library.files(GGUF_REPO)
    entry = listing.entry()
    int4 = library.fit(listing, entry, context_tokens=1000, weights="int4", device="cpu")
    auto = library.fit(listing, entry, context_tokens=1000, weights="auto", device="cpu")
    assert int4.weight_bytes == GGUF.stat().st_size and "file size" in int4.describe()
    assert auto.weight_bytes == 134515008 * 4 and auto.weight_format == "float32"  # dequantized on the CPU
    assert auto.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4 and auto.kv_bytes == auto.kv_bytes_per_token * 1000
    assert auto.memory == "RAM" and auto.level == "green"

    tiny = library.files(TINY_REPO)
    fit = library.fit(tiny, tiny.entry(), context_tokens=100, device="cpu")
    params = sum(p.numel() for p in build_model("llama").parameters())
    assert fit.weight_bytes == params * 4 and fit.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert model_fit.fit_local(str(tiny_folder), context_tokens=100, device="cpu").weight_bytes == fit.weight_bytes


def test_fit_levels_name_the_memory_and_the_numbers():
    kw = dict(kv_per_token=1000, context_tokens=1000, weight_format="int4", device="cpu")
    gb = 1 << 30
    green = model_fit.judge(gb, available=(2 * gb, 2 * gb), **kw)
    assert green.level == "green" and green.memory == "RAM" and "1.0 GB (int4)" in green.describe()
    streamed = model_fit.judge(4 * gb, streamed_resident_bytes=gb // 2, available=(2 * gb, 2 * gb), **kw)
    assert streamed.level == "yellow" and "layer streaming" in streamed.summary
    red = model_fit.judge(4 * gb, available=(2 * gb, 2 * gb), **kw)
    assert red.level == "red" and "2.0 GB free" in red.summary


# -- the command line ----------------------------------------------------------------------------------------
def run_cli(*args, env, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli.kvboost", "models", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=Path(__file__).resolve().parents[2])


def test_the_cli_downloads_lists_and_removes_through_hf_endpoint_and_hf_home(hub, tmp_path):
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_XET": "1"}
    env.pop("HF_HUB_CACHE", None)
    got = run_cli("download", GGUF_REPO, "Q4_1", env=env)
    assert got.returncode == 0, got.stderr
    path = Path(got.stdout.strip().splitlines()[-1])
    assert path.is_relative_to(tmp_path / "hf-home" / "hub") and sha256(path) == GGUF_SHA
    assert "100%" in got.stderr  # the progress bar

    listed = run_cli("list", env=env)
    assert listed.returncode == 0 and str(path) in listed.stdout and "unfinished" not in listed.stdout
    removed = run_cli("remove", GGUF_REPO, env=env)
    assert removed.returncode == 0 and not path.exists()

    hub.stop()
    down = run_cli("files", GGUF_REPO, env=env)
    assert down.returncode == 1 and "cannot reach" in down.stderr


def test_the_cli_search_and_files_print_models_sizes_and_fits(hub, tmp_path, capsys):
    from cli.kvboost import build_parser

    def run(*argv) -> int:
        args = build_parser().parse_args(["models", "--endpoint", hub.url, "--cache-dir", str(tmp_path), *argv])
        return args.func(args)

    assert run("search", "test-org") == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == [GGUF_REPO, TINY_REPO]
    assert run("files", GGUF_REPO, "--weights", "int4", "--context", "2048") == 0
    out = capsys.readouterr().out
    assert "Q4_1" in out and "weights 93.8 MB int4" in out and "at 2048 tokens" in out
    assert run("download", GGUF_REPO, "Q9_9") == 1
    assert "choose one of: Q4_1" in capsys.readouterr().err
