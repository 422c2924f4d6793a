"""Property-based tests of what the model library takes from a hub: the name checks (hub.hub_names) on their
own, and any model-info, file-header and search answer served by a fake hub on 127.0.0.1 (one server for the
module, each example's answer set through its state). A download ends inside the cache folder or raises the
ModelHubError family, never another exception, and nothing is created outside the cache."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import string
from pathlib import Path

import pytest
from fake_hub import FakeHub, Faults
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hub import hub_names
from hub.models import ModelHub, ModelHubError, RefusedHubAnswer

REPO = "test-org/fuzzed"
CLIMB = 8  # the most `../` a generated name holds; the cache sits deeper than that below the test's folder
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ANY_BYTES = random.Random(2).randbytes(4096)
ANY_SHA256 = hashlib.sha256(ANY_BYTES).hexdigest()
ANY_GIT_SHA1 = hashlib.sha1(b"blob 4096\0" + ANY_BYTES).hexdigest()


# -- the checks on their own ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("check, value, expected", [
    (hub_names.etag, '"' + "a" * 64 + '"', "a" * 64), (hub_names.etag, 'W/"' + "b" * 40 + '"', "b" * 40),
    (hub_names.commit, "0123456789abcdef0123456789abcdef01234567", "0123456789abcdef0123456789abcdef01234567"),
    (hub_names.file_name, "Q4_K_M/model-Q4_K_M-00001-of-00002.gguf", "Q4_K_M/model-Q4_K_M-00001-of-00002.gguf"),
    (hub_names.file_name, "nötes ...txt", "nötes ...txt"), (hub_names.revision, "refs/pr/1", "refs/pr/1"),
    (hub_names.repo_id, "Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"),
    (hub_names.repo_id, "gpt2", "gpt2"),
])
def test_names_in_the_shapes_the_hub_sends_pass(check, value, expected):
    assert (check(value, "x") if check is hub_names.etag else check(value)) == expected


@pytest.mark.parametrize("check, value", [
    (hub_names.etag, '"../../../outside/x"'), (hub_names.etag, '"/etc/x"'), (hub_names.etag, '"' + "A" * 64 + '"'),
    (hub_names.etag, '"' + "a" * 63 + '"'), (hub_names.etag, None), (hub_names.etag, ["a" * 64]),
    (hub_names.commit, "../../../outside/snapcommit"), (hub_names.commit, "main"), (hub_names.commit, 12),
    (hub_names.commit, "a" * 41),
    (hub_names.file_name, "../x.gguf"), (hub_names.file_name, "/abs/x.gguf"), (hub_names.file_name, "a//b"),
    (hub_names.file_name, "a/./b"), (hub_names.file_name, "a/"), (hub_names.file_name, ""),
    (hub_names.file_name, "a\\..\\b"), (hub_names.file_name, "a\x00b"), (hub_names.file_name, "a\nb"),
    (hub_names.file_name, "x" * 256), (hub_names.file_name, "a/" * 600), (hub_names.file_name, None),
    (hub_names.file_name, 7), (hub_names.revision, "../../x"), (hub_names.revision, "/x"),
    (hub_names.repo_id, "../x"), (hub_names.repo_id, "a/b/c"), (hub_names.repo_id, "a--b"),
    (hub_names.repo_id, "café/x"), (hub_names.repo_id, None),
])
def test_names_of_any_other_shape_are_refused_naming_the_value(check, value):
    with pytest.raises(RefusedHubAnswer, match="refused .*nothing was written") as refused:
        check(value, "the field") if check is hub_names.etag else check(value)
    assert hub_names.shown(value) in str(refused.value)


def test_a_refused_value_is_shown_cut_short():
    with pytest.raises(RefusedHubAnswer) as refused:
        hub_names.file_name("../" * 100_000)
    assert len(str(refused.value)) < 300 and "'../../" in str(refused.value)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from("/.a\\\x00 é"), max_size=14) | st.text(max_size=30))
def test_a_file_name_that_passes_stays_inside_its_folder(name):
    try:
        checked = hub_names.file_name(name)
    except RefusedHubAnswer:
        return
    assert os.path.normpath(os.path.join("/base/snapshot", checked)).startswith("/base/snapshot/")


# -- any answer from a hub -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def any_file(tmp_path_factory) -> Path:
    """What the fuzzed hub serves at every file path."""
    path = tmp_path_factory.mktemp("served") / "any"
    path.write_bytes(ANY_BYTES)
    return path


@pytest.fixture(scope="module")
def fuzz_hub():
    hub = FakeHub().start()
    yield hub
    hub.stop()


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    """The module's folder with the cache CLIMB + 2 folders below it, and where absolute names point."""
    base = tmp_path_factory.mktemp("fuzz")
    deep = base.joinpath(*(f"d{i}" for i in range(CLIMB + 1)))
    deep.mkdir(parents=True)
    return base, deep / "cache", base / "abs"


def written_outside(base: Path, cache: Path) -> list[str]:
    """What exists under `base` other than the cache's folder, what is in it and the folders above it."""
    above = set(cache.parents)
    found = []
    for folder, dirs, files in os.walk(base):  # links are listed, never entered
        for name in dirs + files:
            path = Path(folder) / name
            if path not in above and not path.is_relative_to(cache):
                found.append(str(path.relative_to(base)))
        dirs[:] = [d for d in dirs if not (Path(folder) / d).is_relative_to(cache)]
    return found


JUNK = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                 st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.text(max_size=10),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=10)


def hexes(n: int):
    return st.text("0123456789abcdef", min_size=n, max_size=n)


def climbing(tail: str):
    return st.integers(1, CLIMB).map(lambda k: "../" * k + tail)


FIELDS = ("id", "sha", "siblings", "rfilename", "size", "blobId", "lfs", "lfs.size", "lfs.sha256", "tags", "config",
          "gguf", "safetensors", "answer", "ETag", "X-Linked-Etag", "X-Linked-Size")


def hostile_fields():
    """Which fields of an answer are hostile (none: the answer is the hub's own shape throughout)."""
    return st.sets(st.sampled_from(FIELDS), max_size=3)


def pick(field: str, hostile: set, fine, *bad):
    """`fine`, or for a hostile field `fine` or one of `bad` (some siblings of a hostile listing stay fine)."""
    return st.one_of(fine, *bad) if field in hostile else fine


def model_info(absolute: Path, hostile: set):
    """A model-info answer in the hub's shape, the fields in `hostile` hostile."""
    size = st.sampled_from([None, len(ANY_BYTES)])
    bad_sizes = (st.sampled_from([0, 1000]), st.integers(-2**70, 2**70), JUNK)
    bad_hashes = (hexes(64), hexes(40), climbing("outside/h"), st.text(max_size=70), JUNK)
    names = pick("rfilename", hostile, st.sampled_from(
        ["model.Q4_0.gguf", "config.json", "model.safetensors", "sub/model.Q8_0.gguf", "tokenizer.json",
         "a b.Q4_1.gguf", "model.Q4_0.gguf/inner.gguf"]),
        climbing("outside/x.gguf"), st.just(str(absolute / "x.gguf")),
        st.lists(st.sampled_from(["a", ".", "..", "", "b.gguf", "c\\d", "e\x00"]), min_size=1, max_size=5).map(
            "/".join),
        st.text(max_size=20), JUNK)
    lfs = pick("lfs", hostile, st.none() | st.fixed_dictionaries({
        "size": pick("lfs.size", hostile, size, *bad_sizes),
        "sha256": pick("lfs.sha256", hostile, st.just(ANY_SHA256), *bad_hashes), "pointerSize": st.integers()}),
        JUNK)
    sibling = pick("siblings", hostile, st.fixed_dictionaries({
        "rfilename": names, "size": pick("size", hostile, size, *bad_sizes),
        "blobId": pick("blobId", hostile, st.sampled_from([None, ANY_GIT_SHA1]), *bad_hashes), "lfs": lfs}), JUNK)
    return st.fixed_dictionaries({
        "id": pick("id", hostile, st.just(REPO), st.text(max_size=10), JUNK),
        "sha": pick("sha", hostile, hexes(40), climbing("outside/snapcommit"), st.just(str(absolute / "snap")),
                    st.text(max_size=45), JUNK),
        "siblings": pick("siblings", hostile, st.lists(sibling, min_size=1, max_size=4), JUNK),
        "tags": pick("tags", hostile, st.lists(st.sampled_from(["gguf", "llama", "safetensors"]), max_size=3),
                     st.lists(JUNK, max_size=2), JUNK),
        "config": pick("config", hostile, st.fixed_dictionaries({"model_type": st.just("llama")}),
                       st.fixed_dictionaries({}, optional={
                           "model_type": JUNK,
                           "quantization_config": st.fixed_dictionaries({"quant_method": st.just("awq") | JUNK}) | JUNK,
                       }), JUNK),
        "gguf": pick("gguf", hostile, st.fixed_dictionaries({"architecture": st.just("llama"), "total": size}),
                     st.fixed_dictionaries({}, optional={"architecture": JUNK, "total": st.one_of(*bad_sizes)}), JUNK),
        "safetensors": pick("safetensors", hostile, st.just({"parameters": {"F32": 10}, "total": 10}),
                            st.fixed_dictionaries({"parameters": JUNK, "total": st.one_of(*bad_sizes)}), JUNK)})


def hub_answer(absolute: Path, hostile: set):
    """A model-info answer, or for a hostile "answer" any JSON or no JSON at all."""
    return pick("answer", hostile, model_info(absolute, hostile), JSON, st.binary(max_size=16))


def file_headers(absolute: Path, hostile: set):
    """What the file answers (HEAD and GET) say in place of their own ETag and size, or nothing."""
    printable = st.text(alphabet=string.ascii_letters + string.digits + '/."- ', max_size=70)
    etags = {field: pick(field, hostile, st.sampled_from([ANY_SHA256, ANY_GIT_SHA1]), hexes(64),
                         climbing("outside/x"), st.just(str(absolute / "x")), printable).map(lambda e: f'"{e}"')
             for field in ("ETag", "X-Linked-Etag")}
    size = pick("X-Linked-Size", hostile, st.just(str(len(ANY_BYTES))), st.sampled_from(["0", "-5", "1e3", "10" * 12]),
                st.integers(-2**64, 2**64).map(str))
    return st.fixed_dictionaries({}, optional={**etags, "X-Linked-Size": size})


@FUZZ
@given(data=st.data())
def test_any_model_info_and_file_answer_downloads_inside_the_cache_or_is_a_model_hub_error(fuzz_hub, any_file,
                                                                                            layout, data):
    base, cache, absolute = layout
    hostile = data.draw(hostile_fields(), label="hostile fields")
    fuzz_hub.faults = Faults(info={REPO: data.draw(hub_answer(absolute, hostile), label="model info")},
                             headers=data.draw(file_headers(absolute, hostile), label="file headers"),
                             any_file=any_file)
    library = ModelHub(endpoint=fuzz_hub.url, cache_dir=cache, token=False, timeout_s=5)
    try:
        try:
            path = library.download(REPO)
        except ModelHubError as exc:
            event(type(exc).__name__)  # --hypothesis-show-statistics: how the examples ended
        else:
            event("downloaded")
            assert path.resolve().is_relative_to(cache.resolve()) and path.exists()
        library.downloaded()  # whatever is left, the scan reads it
        assert written_outside(base, cache) == []
    finally:
        shutil.rmtree(cache, ignore_errors=True)


@FUZZ
@given(answer=hostile_fields().flatmap(lambda hostile: st.lists(model_info(Path("/nowhere"), hostile), max_size=3))
       | JSON | st.binary(max_size=16))
def test_any_search_answer_is_results_or_a_model_hub_error(fuzz_hub, layout, answer):
    fuzz_hub.faults = Faults(search=b"null" if answer is None else answer)
    library = ModelHub(endpoint=fuzz_hub.url, cache_dir=layout[1], token=False, timeout_s=5)
    try:
        results = library.search("x", supported_only=False)
    except ModelHubError as exc:
        event(type(exc).__name__)
        return
    event(f"{len(results)} results")
    for r in results:
        hub_names.repo_id(r.repo)
        assert isinstance(r.downloads, int) and isinstance(r.likes, int) and r.downloads >= 0
        assert r.parameters is None or isinstance(r.parameters, int)
        assert r.architecture is None or isinstance(r.architecture, str)
