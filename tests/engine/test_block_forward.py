"""The one-call forward (engine.block_forward, engine/block_forward.c) against transformers' own forward over the
same modules: the same logits and the same cache bit for bit, whole prompts, prompts cut into pieces and decode
steps, Llama and Qwen2 (biases), every block type; calls it does not take fall back; a changed model is never
computed from stale pointers; a model it cannot run is left as it was."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cpu_kernels import needs_cpu_kernel
from gguf_files import tiny_gguf
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from engine import live_cache
from engine.block_forward import RowNorm, RowSiLU, unsupported, use_block_forward, uses_block_forward
from engine.exact_attention import ROWS, use_exact_attention
from engine.live_cache import GrowingCache
from engine.weights import gguf_blocks
from engine.weights.fingerprint import fingerprint
from engine.weights.loader import load_model, quiet_transformers, resolve_source

pytestmark = pytest.mark.skipif(gguf_blocks.unavailable() is not None,
                                reason=f"block kernel unavailable: {gguf_blocks.unavailable()}")
CPU = torch.device("cpu")
IDS = [5, 70, 300, 12, 400, 9, 33, 200, 201, 202, 17, 18, 260, 4, 90, 91, 92, 511, 3, 44]

quiet_transformers()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    made: dict = {}

    def get(kind: str, arch: str = "llama"):
        if (kind, arch) not in made:
            base, types = MIXED.get(kind, (kind, None))
            made[kind, arch] = tiny_gguf(folder / f"{arch}-{kind.replace('/', '-')}.gguf", base, arch=arch,
                                         linear_types=types)
        return made[kind, arch]

    return get


def blocks_model(path):
    model = load_model(resolve_source(str(path)), CPU, torch.float32, weights="int4", kernel=gguf_blocks.KERNEL)[0]
    use_exact_attention(model)
    assert model.config._attn_implementation == ROWS
    return model


def run(forward, pieces: list[int], new: int = 4) -> tuple[torch.Tensor, GrowingCache]:
    """Logits of every position of IDS fed in `pieces`, then of `new` greedy decode steps; and the cache."""
    cache, out = GrowingCache(), []
    with torch.inference_mode():
        at = 0
        for size in pieces:
            out.append(forward(input_ids=torch.tensor([IDS[at:at + size]]), past_key_values=cache,
                               use_cache=True).logits[0])
            at += size
        for _ in range(new):
            token = out[-1][-1].argmax().view(1, 1)
            out.append(forward(input_ids=token, past_key_values=cache, use_cache=True).logits[0])
    return torch.cat(out), cache


def same_cache(a: GrowingCache, b: GrowingCache) -> bool:
    return len(a.layers) == len(b.layers) and all(
        torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values) for x, y in zip(a.layers, b.layers))


# Files whose linears mix types, as Q4_K_M files do: the projections of one input (q, k, v; gate, up) computed
# in one call where their activations round alike, one call each where they do not.
MIXED = {"mixed 32": ("Q4_0", {"attn_k.weight": "Q4_1", "attn_v.weight": "Q8_0", "ffn_up.weight": "Q8_0"}),
         "mixed 32/256": ("Q4_K", {"attn_v.weight": "Q4_1", "ffn_up.weight": "Q8_0", "attn_k.weight": "Q6_K"})}


@pytest.mark.parametrize("kind,arch", [("Q4_K", "llama"), ("Q4_1", "llama"), ("Q4_0", "llama"),
                                       ("Q8_0", "llama"), ("Q6_K", "llama"), ("Q4_K", "qwen2"),
                                       ("mixed 32", "llama"), ("mixed 32/256", "qwen2")])
def test_the_one_call_forward_gives_transformers_logits_and_cache_bit_for_bit(files, kind, arch, one_thread):
    model = blocks_model(files(kind, arch))
    assert unsupported(model) is None and use_block_forward(model)
    forward = model.forward
    reference_logits, reference_cache = run(forward.original, [len(IDS)])
    assert forward.one_call_forwards == 0
    for pieces in ([len(IDS)], [7, 13], [1] * 5 + [15]):
        logits, cache = run(forward, pieces)
        assert torch.equal(logits, reference_logits), pieces
        assert same_cache(cache, reference_cache), pieces
    assert forward.one_call_forwards == 5 + 6 + 10  # every forward above ran in one call


def test_two_threads_give_the_one_threads_numbers(files):
    model = blocks_model(files("Q4_K"))
    use_block_forward(model)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = run(model, [len(IDS)])
        torch.set_num_threads(2)
        two, _ = run(model, [len(IDS)])
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(one, two)


def test_calls_it_does_not_take_run_the_models_own_forward_with_the_same_numbers(files, one_thread):
    model = blocks_model(files("Q4_K"))
    use_block_forward(model)
    ids = torch.tensor([IDS])
    with torch.inference_mode():
        plain = model(input_ids=ids, past_key_values=GrowingCache(), use_cache=True).logits
        masked = model(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=GrowingCache(),
                       use_cache=True).logits
        placed = model(input_ids=ids, position_ids=torch.arange(len(IDS))[None], past_key_values=GrowingCache(),
                       use_cache=True).logits
        uncached = model(input_ids=ids, use_cache=False).logits
    assert model.forward.one_call_forwards == 1
    assert torch.equal(plain, masked) and torch.equal(plain, placed) and torch.equal(plain, uncached)


def test_a_replaced_layer_is_computed_with_its_new_weights(files, one_thread):
    model, other = blocks_model(files("Q4_K")), blocks_model(files("Q4_1"))
    use_block_forward(model)
    run(model, [5])  # the pointers into the first weights are built
    model.model.layers[1].mlp.down_proj = other.model.layers[1].mlp.down_proj
    expected, _ = run(model.forward.original, [len(IDS)])
    got, _ = run(model, [len(IDS)])
    assert torch.equal(got, expected)
    before = model.forward.one_call_forwards
    model.model.layers[0].input_layernorm = LlamaRMSNorm(model.config.hidden_size)  # not the C norm any more
    expected, _ = run(model.forward.original, [len(IDS)])
    got, _ = run(model, [len(IDS)])
    assert torch.equal(got, expected) and model.forward.one_call_forwards == before


def test_replaced_parents_and_tensors_are_computed_with_their_new_weights(files, one_thread):
    """Where a forward finds its modules is checked parent first: a whole MLP, a whole layer, or a linear's blocks
    replaced under an array already built are computed with what replaced them (by the one-call forward)."""
    model, other = blocks_model(files("Q4_K")), blocks_model(files("Q4_1"))
    use_block_forward(model)
    use_block_forward(other)
    run(model, [5])  # the pointers into the first weights are built

    def replaced(change):
        change()
        expected, _ = run(model.forward.original, [len(IDS)])
        before = model.forward.one_call_forwards
        got, _ = run(model, [len(IDS)])
        assert model.forward.one_call_forwards > before and torch.equal(got, expected)

    replaced(lambda: setattr(model.model.layers[1], "mlp", other.model.layers[1].mlp))
    replaced(lambda: model.model.layers.__setitem__(0, other.model.layers[0]))
    linear = model.model.layers[1].self_attn.o_proj
    old = linear.blocks  # kept alive: an array still pointing at it would read these values
    replaced(lambda: setattr(linear, "blocks", torch.cat([old[16:], old[:16]])))  # rotated by a 16-row tile
    # Written into the module's dict, as Module._apply does: no registration hook sees it. Right after a one-call
    # forward (nothing registered since), so the next forward's check is the one for such writes.
    gate = model.model.layers[0].mlp.gate_proj
    old_gate = gate.blocks
    run(model, [len(IDS)])
    gate._buffers["blocks"] = torch.cat([old_gate[16:], old_gate[:16]])
    before = model.forward.one_call_forwards
    got, _ = run(model, [len(IDS)])
    expected, _ = run(model.forward.original, [len(IDS)])
    assert model.forward.one_call_forwards > before and torch.equal(got, expected)


def test_a_silu_replaced_after_the_first_forward_sends_forwards_to_the_models_own(files, one_thread):
    model = blocks_model(files("Q4_1"))
    use_block_forward(model)
    run(model, [5])
    model.model.layers[1].mlp.act_fn = torch.nn.SiLU()  # not the C path's SiLU any more
    before = model.forward.one_call_forwards
    got, _ = run(model, [len(IDS)])
    expected, _ = run(model.forward.original, [len(IDS)])
    assert model.forward.one_call_forwards == before and torch.equal(got, expected)


def test_buffers_grown_by_another_forward_are_not_written_through_old_addresses(files, one_thread, monkeypatch):
    """The one-call forward keeps each cache's buffer addresses between steps; a cache grown in between by the
    model's own forward (new buffers, the old ones freed) is read and written in its new buffers."""
    monkeypatch.setattr(live_cache, "BLOCK_TOKENS", 8)
    model = blocks_model(files("Q4_1"))
    use_block_forward(model)
    original = model.forward.original

    def feed(forward, cache, ids):
        return forward(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True).logits[0]

    with torch.inference_mode():
        expected_cache, mixed = GrowingCache(), GrowingCache()
        expected = [feed(original, expected_cache, IDS[:3])]
        got = [feed(model, mixed, IDS[:3])]  # its buffers hold 8 positions
        for at in (3, 4):
            expected.append(feed(original, expected_cache, [IDS[at]]))
            got.append(feed(model, mixed, [IDS[at]]))  # written in place: the addresses kept
        before = mixed.generations(len(mixed.layers))
        expected.append(feed(original, expected_cache, IDS[5:12]))
        got.append(feed(original, mixed, IDS[5:12]))  # 12 positions: new buffers, by transformers' update
        assert mixed.generations(len(mixed.layers)) != before
        for at in range(12, 16):
            expected.append(feed(original, expected_cache, [IDS[at]]))
            got.append(feed(model, mixed, [IDS[at]]))
    assert torch.equal(torch.cat(got), torch.cat(expected)) and same_cache(mixed, expected_cache)


def test_a_copied_model_computes_from_its_own_weights(files, one_thread):
    model = blocks_model(files("Q4_K"))
    use_block_forward(model)
    before, _ = run(model, [len(IDS)])
    twin = copy.deepcopy(model)
    assert uses_block_forward(twin) and twin.forward.model is twin
    twin.model.layers[0].self_attn.q_proj.blocks.zero_()  # a weight of the copy only
    changed, _ = run(twin, [len(IDS)])
    again, _ = run(model, [len(IDS)])
    assert torch.equal(again, before) and not torch.equal(changed, before)
    assert twin.forward.one_call_forwards > 0


@needs_cpu_kernel
def test_a_model_it_cannot_run_is_left_as_it_was(files, one_thread):
    float_model = load_model(resolve_source(str(files("Q4_K"))), CPU, torch.float32, weights="int4",
                             kernel="cpu_int4pack")[0]  # int4 layers on torch's kernel, under ROWS
    use_exact_attention(float_model)
    assert float_model.config._attn_implementation == ROWS and "not GGUF blocks" in unsupported(float_model)
    forward = float_model.forward
    assert not use_block_forward(float_model)
    assert float_model.forward == forward and not uses_block_forward(float_model)
    assert not any(isinstance(m, (RowNorm, RowSiLU)) for m in float_model.modules())


def test_its_norm_and_silu_are_an_rms_norm_and_silu_and_change_the_fingerprint(files, one_thread):
    model = blocks_model(files("Q4_K"))
    reference = model.model.layers[0].input_layernorm
    before = fingerprint(model)
    use_block_forward(model)
    ours = model.model.layers[0].input_layernorm
    assert isinstance(ours, RowNorm) and isinstance(model.model.layers[0].mlp.act_fn, RowSiLU)
    x = torch.randn(3, 5, model.config.hidden_size) * 4
    with torch.inference_mode():
        assert torch.allclose(ours(x), reference(x), rtol=1e-5, atol=1e-6)
        y = torch.randn(1000) * 10
        assert torch.allclose(model.model.layers[0].mlp.act_fn(y), torch.nn.functional.silu(y), rtol=1e-5, atol=1e-6)
    assert fingerprint(model) != before  # KV computed with transformers' norms is never served to these


def test_silu_gives_each_value_the_same_bits_in_a_vector_as_alone_and_stays_near_silu():
    """kvb_silu takes 16 (or 8) values at a time and the rest one by one: a value's result must not depend on
    where in the tensor it sits, since a prompt's cut decides that (the exponential is the library's own)."""
    silu = RowSiLU()
    values = torch.cat([torch.linspace(-100, 100, 4001), torch.randn(2000) * 6,
                        torch.tensor([0.0, -0.0, 87.9, 88.0, 88.1, -87.9, -88.0, -88.1, 1e-30, -1e-30,
                                      float("inf"), float("-inf"), float("nan"), 3.4e38, -3.4e38])])
    with torch.inference_mode():
        together = silu(values)
        alone = torch.cat([silu(values[i:i + 1]) for i in range(values.numel())])
        shifted = silu(values[3:])  # every value in another lane
    assert torch.equal(together.view(torch.int32), alone.view(torch.int32))
    assert torch.equal(together[3:].view(torch.int32), shifted.view(torch.int32))
    finite = values.isfinite()
    exact = torch.nn.functional.silu(values[finite].double())
    # past exp's ceiling (x < -88) the result is -0 where silu is at most 6e-37 from it
    assert ((together[finite].double() - exact).abs() <= 4e-7 * exact.abs() + 6e-37).all()
    assert together[values == float("inf")].item() == float("inf")
    assert together[values.isnan()].isnan().all()


SILU_CHILD = """
import json, sys, torch
from engine.block_forward import RowSiLU
from engine.weights import gguf_blocks
values = torch.tensor(json.loads(sys.stdin.read()))
print(json.dumps({"path": gguf_blocks.vector_path(), "bits": RowSiLU()(values).view(torch.int32).tolist()}))
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="builds for another x86 CPU")
def test_an_avx2_build_gives_silu_the_same_bits_as_this_build(tmp_path):
    """Eight lanes (AVX2) and sixteen (AVX-512) run the same exponential: KV of one is served to the other."""
    values = torch.cat([torch.linspace(-100, 100, 2001), torch.randn(999) * 6])
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "KVBOOST_CACHE_DIR": str(tmp_path), "KVBOOST_BLOCKS_MARCH": "haswell"}
    done = subprocess.run([sys.executable, "-c", SILU_CHILD], cwd=root, env=env, input=json.dumps(values.tolist()),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["path"] == "avx2"
    with torch.inference_mode():
        assert result["bits"] == RowSiLU()(values).view(torch.int32).tolist()


def test_an_engine_over_blocks_answers_through_the_one_call_forward(files, one_thread):
    from engine import EngineConfig, KVBoost

    model, tokenizer = load_model(resolve_source(str(files("Q4_K"))), CPU, torch.float32, weights="int4",
                                  kernel=gguf_blocks.KERNEL)
    engine = KVBoost(model, tokenizer, EngineConfig.of(disk_cache_bytes=0, chunk_size=16))
    assert uses_block_forward(engine.model)
    first = engine.generate("the same words " * 6, max_new_tokens=6)
    second = engine.generate("the same words " * 6, max_new_tokens=6)
    assert second.stats.reused_tokens > 0 and second.token_ids == first.token_ids
    assert engine.model.forward.one_call_forwards > 0


def test_every_prefill_piece_runs_in_one_call_with_the_numbers_of_the_whole_prompt(files, one_thread):
    from dataclasses import replace

    from engine import EngineConfig, KVBoost

    model, tokenizer = load_model(resolve_source(str(files("Q4_0"))), CPU, torch.float32, weights="int4",
                                  kernel=gguf_blocks.KERNEL)
    config = EngineConfig.of(disk_cache_bytes=0, reuse="off", prefill_piece_tokens=8, speculative=None)
    engine = KVBoost(model, tokenizer, config)
    forward = engine.model.forward
    before = forward.one_call_forwards
    pieces = engine.generate("a prompt of some words, cut into pieces " * 3, max_new_tokens=1, return_logits=True)
    calls = forward.one_call_forwards - before
    whole = engine.with_config(replace(config, decode=replace(config.decode, prefill_piece_tokens=None))).generate(
        "a prompt of some words, cut into pieces " * 3, max_new_tokens=1, return_logits=True)
    assert calls == -(-pieces.stats.prompt_tokens // 8) > 1  # each piece one call, not only the last
    assert torch.equal(pieces.first_logits, whole.first_logits)


@pytest.mark.slow
def test_reused_turns_of_the_embedded_model_give_the_uncached_logits_bit_for_bit(smollm):
    """The default load (the file's blocks on this CPU, or int4 layers): multi-turn chats answered with their
    earlier turns reused (PREFIX/EXACT hits) give the first token's logits and the greedy answer of an uncached
    run bit for bit, whatever the cut of the prompt into forwards."""
    cached = smollm.with_options(speculative=None)
    plain = smollm.with_options(reuse="off", speculative=None)
    topics = ["a lighthouse keeper", "the water cycle", "sorting a list in Python", "a recipe for bread"]
    compared, reused = 0, 0
    for topic in topics:
        messages = [{"role": "system", "content": f"You are a helpful assistant. The user asks about {topic}."}]
        for turn in ("Tell me about it in two sentences.", "Why does that matter?", "Say it again, shorter."):
            messages.append({"role": "user", "content": turn})
            got = cached.chat(messages, max_new_tokens=16, return_logits=True)
            want = plain.chat(messages, max_new_tokens=16, return_logits=True)
            assert got.token_ids == want.token_ids and torch.equal(got.first_logits, want.first_logits)
            compared += 1
            reused += got.stats.reused_tokens
            messages.append({"role": "assistant", "content": got.text})
    assert compared == 12 and reused > 0


def test_a_request_run_alone_takes_the_packed_entry_with_the_same_bits(files, one_thread):
    """generate.run_forward (a request's decode step or check, run by itself) goes straight to the one-call
    forward's packed entry: the logits and the KV of transformers' own forward over the same modules, bit for bit,
    for one token and for a token with three drafts (rows one position at a time)."""
    from engine.batching import Forward
    from engine.generate import run_forward

    model = blocks_model(files("Q4_1"))
    use_block_forward(model)
    _, cache = run(model, [len(IDS)], new=0)
    reference = copy.deepcopy(cache)
    entered, packed = [], model.forward.packed
    model.forward.packed = lambda tokens, caches, keeps=None: entered.append(tokens) or packed(tokens, caches, keeps)
    for tokens in ([300], [12, 400, 9, 33]):
        before = model.forward.one_call_forwards
        got = run_forward(model, Forward(list(tokens), cache, rowwise=len(tokens) > 1), CPU)
        assert model.forward.one_call_forwards == before + 1 and entered[-1] == [list(tokens)]
        with torch.inference_mode():
            want = torch.cat([model.forward.original(input_ids=torch.tensor([[t]]), past_key_values=reference,
                                                     use_cache=True).logits[0] for t in tokens])
        assert torch.equal(got, want)
        assert all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
                   for a, b in zip(cache.layers, reference.layers))


PREFIX = [(7 * i + 3) % 500 + 1 for i in range(80)]  # a beginning long enough to be read where another request has it


def prefilled(forward, ids: list[int]) -> GrowingCache:
    cache = GrowingCache()
    with torch.inference_mode():
        forward(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
    return cache


def packed_step(forward, caches: list[GrowingCache], tokens: list[int]) -> list[torch.Tensor]:
    with torch.inference_mode():
        return forward.packed([[t] for t in tokens], caches)


def test_requests_that_begin_alike_read_one_copy_of_their_beginning_with_the_logits_they_get_alone(files, one_thread):
    """Three requests over one 80-token beginning and a fourth that begins otherwise, decoded together: the later
    ones read the first one's keys and values for the shared positions (found bit for bit), each request's logits
    and cache those it gets stepping alone; a beginning that differs in one bit of one deep layer is shared only up
    to that position."""
    model = blocks_model(files("Q4_1"))
    assert use_block_forward(model)
    forward = model.forward
    prompts = [PREFIX + [11, 12], PREFIX + [40], PREFIX + [41, 42, 43], [9] + PREFIX]
    caches = [prefilled(forward, p) for p in prompts]
    lead, shared = forward._leads(caches, [len(p) for p in prompts], len(model.model.layers))
    assert list(lead) == [0, 0, 0, 0] and list(shared) == [0, 80, 80, 0]
    alone = [prefilled(forward, p) for p in prompts]
    tokens = [100, 101, 102, 103]
    for step in range(3):
        together = packed_step(forward, caches, tokens)
        for i, token in enumerate(tokens):
            assert torch.equal(together[i], packed_step(forward, [alone[i]], [token])[0]), (step, i)
        tokens = [t + 1 for t in tokens]
    assert all(same_cache(a, b) for a, b in zip(caches, alone))

    deep = prefilled(forward, PREFIX + [50])
    layer = deep.layers[1]
    changed = layer.values.clone()
    changed[0, 0, 70, 5] = torch.nextafter(changed[0, 0, 70, 5], torch.tensor(float("inf")))
    layer.values = changed  # one bit of position 70, second layer's values
    assert list(forward._leads([caches[0], deep], [83, 81], len(model.model.layers))[1]) == [0, 70]


@pytest.mark.skipif("avx512f" not in gguf_blocks.cpu_flags().split(),
                    reason="only the AVX-512 rows of engine/exact_attention.c read a beginning in another request's "
                           "cache; AVX2 and portable rows read their own copy (the same bits), so a change made "
                           "behind the lead's back cannot show here")
def test_a_request_reads_its_beginning_where_the_request_before_it_holds_it(files, one_thread):
    """What shows that the shared positions are read in the other cache and not in the request's own: the lead's
    copy changed in place (its generation the same, so the pair is not compared again) changes the follower's
    logits; changed through an assignment (a crop or a CacheBlend pass does that), the pair is compared again and
    the follower reads its own copy."""
    model = blocks_model(files("Q4_1"))
    assert use_block_forward(model)
    forward = model.forward
    prompts = [PREFIX + [11], PREFIX + [40]]
    caches = [prefilled(forward, p) for p in prompts]
    expected = packed_step(forward, [prefilled(forward, prompts[1])], [200])[0]
    assert torch.equal(packed_step(forward, caches, [100, 200])[1], expected)
    with torch.inference_mode():
        caches[0].layers[0]._key_buffer[0, :, :60] += 1.0  # in place, behind the cache's back
    assert not torch.equal(packed_step(forward, caches, [101, 201])[1],
                           packed_step(forward, [prefilled(forward, prompts[1] + [200])], [201])[0])

    caches = [prefilled(forward, p) for p in prompts]
    packed_step(forward, caches, [100, 200])
    with torch.inference_mode():
        keys = caches[0].layers[0].keys.clone()
        keys[0, :, :60] += 1.0
    caches[0].layers[0].keys = keys  # a new generation: compared again, found to differ from position 0
    assert torch.equal(packed_step(forward, caches, [101, 201])[1],
                       packed_step(forward, [prefilled(forward, prompts[1] + [200])], [201])[0])


def test_a_request_cut_back_and_grown_otherwise_is_read_alike_only_up_to_the_cut(files, one_thread):
    """A crop (rejected drafts) and other tokens after it: the pair compared before is compared again from the
    cut, and the follower reads the lead's copy only as far as both still hold the same bits."""
    model = blocks_model(files("Q4_1"))
    assert use_block_forward(model)
    forward = model.forward
    n_layers = len(model.model.layers)
    caches = [prefilled(forward, p) for p in (PREFIX + [11], PREFIX + [40])]
    packed_step(forward, caches, [100, 200])
    assert list(forward._leads(caches, [82, 82], n_layers)[1]) == [0, 80]
    caches[1].crop(-10)  # back to 72 positions, then grown with tokens the lead does not have there
    with torch.inference_mode():
        forward(input_ids=torch.tensor([[300, 301]]), past_key_values=caches[1], use_cache=True)
    assert list(forward._leads(caches, [82, 74], n_layers)[1]) == [0, 72]
    alone = prefilled(forward, PREFIX[:72] + [300, 301])
    assert torch.equal(packed_step(forward, caches, [101, 302])[1], packed_step(forward, [alone], [302])[0])
