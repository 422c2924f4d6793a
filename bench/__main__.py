"""`python -m bench [multiturn|sysprompt|rag|needle|all] ...`: the side-by-side reuse benchmark (bench.reuse);
`python -m bench decode ...`: weight formats side by side (bench.decode);
`python -m bench streaming ...`: int4 layer streaming against the resident model (bench.streaming);
`python -m bench speculative ...`: prompt-lookup speculative decoding against one token per forward;
`python -m bench remote ...`: a second process restoring a warmed prompt from the shared KV tier (Redis/Valkey);
`python -m bench batching ...`: concurrent streams through the server, one at a time against batched;
`python -m bench shapes --shape 1.5b|7b`: a real model's shape (random weights) against llama.cpp on the same file;
`python -m bench exactness`: greedy answers with EXACT/PREFIX hits against uncached ones, per weight format."""

import sys

from bench.reuse import main

if __name__ == "__main__":
    if sys.argv[1:2] == ["decode"]:
        from bench.decode import main as decode_main

        sys.exit(decode_main(sys.argv[2:]))
    if sys.argv[1:2] == ["streaming"]:
        from bench.streaming import main as streaming_main

        sys.exit(streaming_main(sys.argv[2:]))
    if sys.argv[1:2] == ["speculative"]:
        from bench.speculative import main as speculative_main

        sys.exit(speculative_main(sys.argv[2:]))
    if sys.argv[1:2] == ["batching"]:
        from bench.batching import main as batching_main

        sys.exit(batching_main(sys.argv[2:]))
    if sys.argv[1:2] == ["shapes"]:
        from bench.shapes import main as shapes_main

        sys.exit(shapes_main(sys.argv[2:]))
    if sys.argv[1:2] == ["exactness"]:
        from bench.exactness import main as exactness_main

        sys.exit(exactness_main(sys.argv[2:]))
    if sys.argv[1:2] == ["remote"]:
        from bench.remote import main as remote_main

        sys.exit(remote_main(sys.argv[2:]))
    sys.exit(main())
