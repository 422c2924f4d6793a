"""The captured CUDA-graph decode step on a GPU (marked `gpu`: skipped without one): the engine's greedy answers
with graphs equal those without, across cache blocks, with drafts, and on an EXACT hit; the graph is recaptured
only when the cache moves to new buffers; bfloat16 steps stay within the dtype's rounding of the eager step."""

from __future__ import annotations

import pytest
import torch
from tiny_models import CHUNK, build_model, build_tokenizer, random_ids

from engine import EngineConfig, KVBoost
from engine.graph_decode import GraphDecode
from engine.live_cache import BLOCK_TOKENS, GrowingCache

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
PROMPT = random_ids(BLOCK_TOKENS - 10, seed=90)  # decoding crosses into the cache's second block


@pytest.fixture(scope="module")
def tiny_cuda():
    return build_model("llama").to(CUDA), build_tokenizer()


def engine_on(tiny_cuda, **config) -> KVBoost:
    fields = dict(chunk_size=CHUNK, disk_cache_bytes=0, speculative=None)
    fields.update(config)
    return KVBoost(*tiny_cuda, EngineConfig.of(**fields), name="tiny-llama")


def test_graph_decoding_gives_the_answers_of_eager_decoding(tiny_cuda):
    graphed = engine_on(tiny_cuda, reuse="off")
    eager = engine_on(tiny_cuda, reuse="off", cuda_graphs=False)
    assert graphed.info().cuda_graphs_unavailable is None
    assert eager.info().cuda_graphs_unavailable == "cuda_graphs=False"
    ours = graphed.generate(PROMPT, max_new_tokens=24, temperature=0)
    theirs = eager.generate(PROMPT, max_new_tokens=24, temperature=0)
    assert ours.token_ids == theirs.token_ids and len(ours.token_ids) == 24
    # one capture for the first block, one when the cache grew into its second
    assert graphed.runner.graph_step.captures == 2


def test_an_exact_hit_decodes_the_same_under_graphs(tiny_cuda):
    engine = engine_on(tiny_cuda)
    first = engine.generate(PROMPT, max_new_tokens=16, temperature=0)
    again = engine.generate(PROMPT, max_new_tokens=16, temperature=0)
    assert again.stats.reused_tokens > 0
    assert again.token_ids == first.token_ids


def test_drafted_checks_and_graph_steps_share_one_cache(tiny_cuda):
    quote = random_ids(40, seed=91)
    prompt = quote + random_ids(20, seed=92) + quote[:10]  # prompt-lookup drafts the rest of the quote
    drafting = engine_on(tiny_cuda, reuse="off", speculative="prompt-lookup")
    plain = engine_on(tiny_cuda, reuse="off", cuda_graphs=False)
    ours = drafting.generate(prompt, max_new_tokens=32, temperature=0)
    assert ours.token_ids == plain.generate(prompt, max_new_tokens=32, temperature=0).token_ids
    assert drafting.runner.graph_step.captures >= 1


def test_a_bfloat16_graph_step_stays_within_rounding_of_the_eager_step():
    model = build_model("qwen2").to(CUDA, torch.bfloat16)
    step = GraphDecode(model)
    prompt = random_ids(100, seed=93)
    caches = []
    for _ in range(2):
        cache = GrowingCache()
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([prompt], device=CUDA), past_key_values=cache).logits[0, -1]
        caches.append(cache)
    for token in random_ids(8, seed=94):
        with torch.inference_mode():
            eager = model(input_ids=torch.tensor([[token]], device=CUDA), past_key_values=caches[0]).logits[0, -1]
        graphed = step(token, caches[1])
        torch.testing.assert_close(graphed.float(), eager.float(), atol=0.05, rtol=0.02)
    assert logits.dtype == torch.bfloat16 and step.captures == 1
