"""Where KV lives between requests: records apart from tensors (store), the device / host / disk / shared tiers,
their file and wire formats, eviction and KIVI quantization. Imports from engine's root only its pure modules
(keys, config); the request path above imports from here (contract in pyproject.toml)."""
