"""A model's weights: sources and formats (loader), GGUF files and their block kernel, int4 / AWQ / GPTQ, the
output head, a load's identity (fingerprint) and report, memory before a load, layer streaming. Imports from
engine's root only config and builtin; the request path above imports from here (contract in pyproject.toml)."""
