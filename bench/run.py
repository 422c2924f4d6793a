"""`python bench/run.py [multiturn|sysprompt|rag|all] [--quick] [--json PATH] [--model SOURCE]`: the same as
`kvboost bench ...`, without installing the project. See bench/README.md."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.reuse import main  # noqa: E402  (needs the repository root on the path first)

if __name__ == "__main__":
    sys.exit(main())
