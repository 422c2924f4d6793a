"""A GGUF file's transformers config, from the metadata engine.weights.gguf_file has already read and checked.

transformers rebuilds the config of a llama / qwen2 / gemma GGUF through its legacy loader, which parses the
whole header again with gguf-py's reader, item by item (the 49152-token vocabulary of the embedded model included):
~6 s of every load on 2 busy cores, against ~0.05 s here. The rules are transformers' own, applied to the same
values: its key table (GGUF_CONFIG_MAPPING) and per-architecture defaults, a one-item array read as its item,
"mistral" for a llama file named so, a tied head when the file has no output.weight, the vocabulary size from
the token list when the metadata states none, gemma3 as gemma3_text. Only the architectures listed in
FAST_ARCHITECTURES, for which those rules are all there is, are read here; `gguf_config` returns None for the
rest (transformers then reads the file itself). Tests compare both configs' to_dict() for each listed one.
"""

from __future__ import annotations

from pathlib import Path

from .gguf_file import GGUFFile

FAST_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
TIED_ANYWAY = ("falcon", "bloom")  # transformers ties these whatever the file holds
RENAMED_MODEL_TYPES = {"gemma3": "gemma3_text"}  # a gemma3 GGUF holds the text decoder only


def gguf_config(file: GGUFFile):
    """The transformers config transformers' GGUF loader would build for `file` (`_name_or_path` its folder), or
    None when its architecture is not one of FAST_ARCHITECTURES. Its sizes are not checked here
    (engine.weights.model_checks)."""
    from transformers import CONFIG_MAPPING
    from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    architecture = file.architecture
    if architecture not in FAST_ARCHITECTURES:
        return None
    names = _as_list(file.metadata.get("general.name", []))
    updated = "mistral" if architecture == "llama" and "mistral" in names else architecture
    values: dict = {"tie_word_embeddings": "output.weight" not in file.tensors or architecture in TIED_ANYWAY}
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(updated, GGUF_CONFIG_DEFAULTS_MAPPING.get(architecture) or {}
                                                       ).items():
        values.setdefault(key, value)
    for key, value in file.metadata.items():
        prefix, _, field = key.replace(architecture, updated).partition(".")
        renamed = GGUF_CONFIG_MAPPING.get(prefix, {}).get(field)
        if renamed is None or renamed == -1:
            continue
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if isinstance(value, str) and architecture in value:
            value = value.replace(architecture, updated)
        values[renamed] = value
    values["model_type"] = RENAMED_MODEL_TYPES.get(values.get("model_type"), values.get("model_type"))
    if "vocab_size" not in values and isinstance(file.metadata.get("tokenizer.ggml.tokens"), list):
        values["vocab_size"] = len(file.metadata["tokenizer.ggml.tokens"])
    config = CONFIG_MAPPING[values["model_type"]].from_dict(values)
    config._name_or_path = str(Path(file.path).parent)
    return config


def _as_list(value) -> list:
    return value if isinstance(value, list) else [value]
