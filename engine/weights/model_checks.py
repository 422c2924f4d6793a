"""What a model's config may say before anything is built from it.

A config.json (or a GGUF's metadata) is outside input: its numbers decide every allocation transformers makes.
Each size is checked against bounds no real model comes near (`CONFIG_LIMITS`), the head layout for consistency,
and the parameters they describe together against the bytes the weight files actually hold: a config claiming a
billion layers over a file of a few MB is refused at once instead of allocating until the machine swaps.
"""

from __future__ import annotations

from pathlib import Path

# field -> (smallest, largest) allowed. The largest are far beyond any released model (Llama 3.1 405B: 126 layers,
# hidden 16384, 128 heads, intermediate 53248; Gemma 3: vocabulary 262144; context windows of 10M tokens).
CONFIG_LIMITS = {
    "num_hidden_layers": (1, 1024),
    "hidden_size": (1, 1 << 17),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (1, 2048),
    "intermediate_size": (1, 1 << 20),
    "vocab_size": (1, 1 << 22),
    "max_position_embeddings": (1, 1 << 27),
}
OPTIONAL = {"num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings"}
# The fewest bits a weight takes in any format a file can hold (IQ1_S: 1.56 bits): a file of B bytes holds at
# most 8 * B / MIN_BITS_PER_WEIGHT weights.
MIN_BITS_PER_WEIGHT = 1.5
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


class ConfigError(ValueError):
    """The config says something no loadable model says; the message names the field and its value."""


def check_config(text_config, weight_bytes: int | None) -> None:
    """Raises ConfigError unless every size in `text_config` (the decoder's config) is a whole number within
    CONFIG_LIMITS, the heads divide as attention needs, and (given `weight_bytes`, the weight files' total size)
    the parameters the sizes describe fit in those bytes."""
    values = {}
    for field, (low, high) in CONFIG_LIMITS.items():
        value = getattr(text_config, field, None)
        if value is None and field in OPTIONAL:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config field {field} must be a whole number, got {_shown(value)}")
        if not low <= value <= high:
            raise ConfigError(f"config field {field} is {value}; a model's must be between {low} and {high}")
        values[field] = value
    heads = values["num_attention_heads"]
    kv_heads = values.get("num_key_value_heads", heads)
    if heads % kv_heads:
        raise ConfigError(f"config field num_key_value_heads is {kv_heads}, which does not divide "
                          f"num_attention_heads ({heads})")
    head_dim = values.get("head_dim")
    if head_dim is None:
        if values["hidden_size"] % heads:
            raise ConfigError(f"config field hidden_size ({values['hidden_size']}) is not a multiple of "
                              f"num_attention_heads ({heads}) and no head_dim is given")
        head_dim = values["hidden_size"] // heads
    if weight_bytes is None:
        return
    params = fewest_parameters(values, heads, kv_heads, head_dim)
    most = 8 * weight_bytes / MIN_BITS_PER_WEIGHT
    if params > most:
        raise ConfigError(
            f"the config describes at least {params / 1e9:.3g} G parameters ({values['num_hidden_layers']} layers "
            f"of hidden size {values['hidden_size']}, vocabulary {values['vocab_size']}), but its weight files "
            f"hold {weight_bytes} bytes: at most {most / 1e9:.3g} G even at {MIN_BITS_PER_WEIGHT} bits a weight")


def fewest_parameters(values: dict, heads: int, kv_heads: int, head_dim: int) -> int:
    """A lower bound on the weights a dense or mixture-of-experts decoder of these sizes holds: the embedding
    table once (it may be tied), each layer's q/k/v/o projections and one gated MLP of `intermediate_size`
    (an MoE layer holds at least that much)."""
    hidden = values["hidden_size"]
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    mlp = 3 * hidden * values.get("intermediate_size", 0)
    return values["vocab_size"] * hidden + values["num_hidden_layers"] * (attention + mlp)


def weight_file_bytes(folder: Path | None, gguf_file: str | None = None) -> int | None:
    """The bytes of a model's weights: the GGUF file's size, or the sum over a folder's weight files (links
    followed, as in the HF cache); None when `folder` is None (not available locally)."""
    if folder is None:
        return None
    if gguf_file is not None:
        return (Path(folder) / gguf_file).stat().st_size
    total = 0
    for path in Path(folder).iterdir():
        if path.name.endswith(WEIGHT_SUFFIXES) and path.is_file():
            total += path.stat().st_size
    return total


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."

