"""`python -m bench [multiturn|sysprompt|rag|needle|all] ...`: the side-by-side reuse benchmark (bench.reuse)."""

import sys

from bench.reuse import main

if __name__ == "__main__":
    sys.exit(main())
