"""Hostile model folders: a config whose numbers describe a model its files cannot hold is refused before anything
is allocated, and code shipped with a model is never run, asked about or imported, with or without a terminal."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import build_model, build_tokenizer

from engine import KVBoost, ModelLoadError, UnsupportedModelError
from engine.weights.model_checks import CONFIG_LIMITS

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny llama folder (config.json, model.safetensors, tokenizer) that loads."""
    folder = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    build_model("llama").save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    return folder


def edited_copy(source: Path, dest: Path, **changes) -> Path:
    """A copy of the model folder `source` with its config.json's fields replaced by `changes`."""
    dest.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file():
            (dest / path.name).write_bytes(path.read_bytes())
    config = json.loads((source / "config.json").read_text())
    config.update(changes)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def test_the_tiny_folder_loads(tiny_folder):
    """The unedited folder loads (so every refusal below is the edit's)."""
    engine = KVBoost.from_pretrained(str(tiny_folder), disk_cache_bytes=0)
    assert engine.model.config.num_hidden_layers == 2


@pytest.mark.parametrize("layers", [10 ** 9, 1e9])
def test_a_billion_layers_is_refused_at_once_without_allocating(tiny_folder, tmp_path, layers):
    folder = edited_copy(tiny_folder, tmp_path / "m", num_hidden_layers=layers)
    t0 = time.monotonic()
    with pytest.raises(ModelLoadError, match="num_hidden_layers"):
        KVBoost.from_pretrained(str(folder), disk_cache_bytes=0)
    assert time.monotonic() - t0 < 20  # it ran past 150 s, RSS climbing, before the check


def test_a_gguf_whose_metadata_claims_a_billion_layers_is_refused_at_once(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "evil.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(10 ** 9)
    writer.add_context_length(2048)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(512)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"w{i}" for i in range(512)])
    writer.add_token_types([1] * 512)
    writer.add_token_merges([])
    writer.add_tensor("token_embd.weight", np.zeros((512, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    t0 = time.monotonic()
    with pytest.raises(ModelLoadError, match="num_hidden_layers is 1000000000"):
        KVBoost.from_pretrained(str(path), disk_cache_bytes=0)
    assert time.monotonic() - t0 < 20


@pytest.mark.parametrize("field, value", [
    ("num_hidden_layers", 100_000), ("hidden_size", 10_000_000), ("num_attention_heads", 100_000),
    ("vocab_size", 1 << 31), ("max_position_embeddings", 1 << 40), ("intermediate_size", 1 << 30),
    ("num_hidden_layers", 0), ("hidden_size", -64), ("num_key_value_heads", 3), ("vocab_size", "512"),
    ("num_hidden_layers", True), ("head_dim", 10_000),
])
def test_a_config_value_out_of_bounds_is_named(tiny_folder, tmp_path, field, value):
    folder = edited_copy(tiny_folder, tmp_path / "m", **{field: value})
    with pytest.raises(ModelLoadError, match=field.replace("num_attention_heads", "(num_)?attention.heads")):
        KVBoost.from_pretrained(str(folder), disk_cache_bytes=0)


def test_a_config_larger_than_its_weight_files_is_refused(tiny_folder, tmp_path):
    """Every number within bounds, but together they describe ~1.3 G parameters over a file of a few hundred KB:
    building it would allocate 5 GB of float32."""
    folder = edited_copy(tiny_folder, tmp_path / "m", num_hidden_layers=200, hidden_size=2048,
                         intermediate_size=8192, num_attention_heads=16, num_key_value_heads=8)
    t0 = time.monotonic()
    with pytest.raises(ModelLoadError, match="weight files"):
        KVBoost.from_pretrained(str(folder), disk_cache_bytes=0)
    assert time.monotonic() - t0 < 20


def test_a_folder_without_weight_files_is_a_clear_error(tiny_folder, tmp_path):
    folder = edited_copy(tiny_folder, tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="weight"):
        KVBoost.from_pretrained(str(folder), disk_cache_bytes=0)


def custom_code_folder(tiny_folder: Path, dest: Path, marker: Path, model_type: str) -> Path:
    """A model folder whose config.json points at Python files of its own (auto_map) that would create `marker`."""
    folder = edited_copy(tiny_folder, dest, model_type=model_type, auto_map={
        "AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilModel"})
    code = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
    (folder / "configuration_evil.py").write_text(code + "from transformers import LlamaConfig\n"
                                                         "class EvilConfig(LlamaConfig):\n    model_type = 'evil'\n")
    (folder / "modeling_evil.py").write_text(code + "from transformers import LlamaForCausalLM as EvilModel\n")
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    tok_config["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (folder / "tokenization_evil.py").write_text(code + "from transformers import PreTrainedTokenizerFast as "
                                                        "EvilTokenizer\n")
    return folder


def test_a_model_that_needs_its_own_code_is_a_clear_error_and_the_code_never_runs(tiny_folder, tmp_path):
    marker = tmp_path / "ran"
    folder = custom_code_folder(tiny_folder, tmp_path / "m", marker, model_type="evil")
    with pytest.raises(ModelLoadError, match="its own Python code"):
        KVBoost.from_pretrained(str(folder), disk_cache_bytes=0)
    assert not marker.exists()


def test_a_known_architecture_with_code_of_its_own_loads_with_the_library_code(tiny_folder, tmp_path):
    marker = tmp_path / "ran"
    folder = custom_code_folder(tiny_folder, tmp_path / "m", marker, model_type="llama")
    engine = KVBoost.from_pretrained(str(folder), disk_cache_bytes=0)
    assert type(engine.model).__module__.startswith("transformers.")
    assert not marker.exists()


def test_loading_from_a_terminal_never_asks_to_run_a_models_code(tiny_folder, tmp_path):
    """With a terminal on stdin transformers asks "Do you wish to run the custom code? [y/N]" and runs it on y:
    here the answer y is already waiting on the terminal, and the code must still not run."""
    marker = tmp_path / "ran"
    folder = custom_code_folder(tiny_folder, tmp_path / "m", marker, model_type="evil")
    script = ("import sys\nfrom engine import KVBoost, ModelLoadError\n"
              "try:\n    KVBoost.from_pretrained(sys.argv[1], disk_cache_bytes=0)\n"
              "except ModelLoadError as exc:\n    print('REFUSED', exc)\n")
    controller, terminal = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-c", script, str(folder)], stdin=terminal, stdout=terminal,
                            stderr=terminal, env=env, cwd=tmp_path)
    os.close(terminal)
    os.write(controller, b"y\ny\ny\n")
    output = b""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([controller], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(controller, 4096)
            except OSError:
                break
            if not chunk:
                break
            output += chunk
        elif proc.poll() is not None:
            break
    proc.wait(timeout=30)
    os.close(controller)
    text = output.decode(errors="replace")
    assert "custom code" not in text.lower() or "REFUSED" in text
    assert "REFUSED" in text, text
    assert not marker.exists()


# -- fuzzing the numbers of a config.json -----------------------------------------------------------------------

VALUES = st.one_of(
    st.integers(min_value=-(1 << 40), max_value=1 << 40), st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(), st.none(), st.text(max_size=8), st.lists(st.integers(0, 10), max_size=3),
    st.sampled_from([0, 1, 2, 3, 7, 64, 1 << 20, 1 << 31, 10 ** 12]),
)
FIELDS = sorted(CONFIG_LIMITS) + ["rope_theta", "rms_norm_eps", "tie_word_embeddings", "torch_dtype"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.dictionaries(st.sampled_from(FIELDS), VALUES, min_size=1, max_size=3))
def test_any_config_values_load_or_are_a_model_load_error(tiny_folder, tmp_path, changes):
    """Whatever numbers the config holds: the model loads within bounded time and memory, or ModelLoadError."""
    import resource

    folder = edited_copy(tiny_folder, tmp_path / f"m{abs(hash(json.dumps(changes, default=str))) % 10**9}",
                         **changes)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    try:
        KVBoost.from_pretrained(str(folder), disk_cache_bytes=0)
    except (ModelLoadError, UnsupportedModelError):
        pass
    assert time.monotonic() - t0 < 60
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 1 << 20  # KiB: under 1 GB more


def test_a_ggufs_tokenizer_is_cached_in_the_engines_cache_folder(tmp_path):
    """disk_cache_dir is the engine's cache folder for everything it keeps: the converted tokenizer of a GGUF
    goes there, never into the user's per-user cache folder (the app's self-test runs with a home of its own)."""
    folder = tmp_path / "kv"
    engine = KVBoost.from_pretrained(None, disk_cache_dir=str(folder), disk_cache_bytes=0)
    assert engine.generate("Hello", max_new_tokens=2).token_ids
    cached = list((folder / "gguf-tokenizers").iterdir())
    assert len(cached) == 1 and (cached[0] / "tokenizer.json").is_file()
