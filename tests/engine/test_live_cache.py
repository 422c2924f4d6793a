"""The live cache grown in blocks: the logits of transformers' own DynamicCache bit for bit (tiny models of
each family, a prefill and decoding across block boundaries), writes in place between growths, and layers
whose keys someone else assigned or cropped (the CacheBlend pass does) carry on correctly."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_model, random_ids
from transformers import DynamicCache

from engine import live_cache
from engine.live_cache import BLOCK_TOKENS, GrowingCache, GrowingLayer
from engine.paged import make_cache


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "gemma3"])
@torch.inference_mode()
def test_decoding_over_a_growing_cache_gives_dynamic_cache_logits_bit_for_bit(arch, monkeypatch):
    monkeypatch.setattr(live_cache, "BLOCK_TOKENS", 16)  # many growths in a short run
    model = build_model(arch)
    ids = random_ids(37, seed=1)
    caches = {"dynamic": DynamicCache(), "growing": GrowingCache()}
    logits = {name: [] for name in caches}
    for name, cache in caches.items():
        out = model(input_ids=torch.tensor([ids[:30]]), past_key_values=cache, use_cache=True)
        logits[name].append(out.logits)
        out = model(input_ids=torch.tensor([ids[30:]]), past_key_values=cache, use_cache=True)
        logits[name].append(out.logits)
        token = int(out.logits[0, -1].argmax())
        for _ in range(40):  # 37 -> 77 positions: past the blocks ending at 48, 64
            out = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            logits[name].append(out.logits)
            token = int(out.logits[0, -1].argmax())
    assert len(logits["growing"]) == len(logits["dynamic"])
    for got, want in zip(logits["growing"], logits["dynamic"]):
        assert torch.equal(got, want)
    dynamic, growing = caches["dynamic"], caches["growing"]
    assert growing.get_seq_length() == dynamic.get_seq_length() == 77
    for mine, theirs in zip(growing.layers, dynamic.layers):
        assert isinstance(mine, GrowingLayer)
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


def kv(tokens: int, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((1, 2, tokens, 4), fill), torch.full((1, 2, tokens, 4), -fill)


def test_updates_write_in_place_until_the_block_is_full():
    layer = GrowingLayer()
    layer.update(*kv(3, 1.0))
    buffer = layer.keys.data_ptr()
    for step in range(BLOCK_TOKENS - 4):  # 3 + (BLOCK - 4) + 1 = BLOCK + 0: the reserved room is not exceeded
        keys, _ = layer.update(*kv(1, 2.0 + step))
        assert keys.data_ptr() == buffer, f"moved at step {step}"
    assert layer.get_seq_length() == BLOCK_TOKENS - 1
    layer.update(*kv(2, 99.0))  # past the capacity: one new buffer, the old content copied over
    assert layer.keys.data_ptr() != buffer
    assert layer.get_seq_length() == BLOCK_TOKENS + 1
    assert torch.equal(layer.keys[:, :, :3], torch.full((1, 2, 3, 4), 1.0))
    assert torch.equal(layer.keys[:, :, 3], torch.full((1, 2, 4), 2.0))
    assert torch.equal(layer.values[:, :, -1], torch.full((1, 2, 4), -99.0))
    assert layer.capacity_bytes() >= layer.keys.nbytes * 2


def test_keys_assigned_from_outside_start_a_new_buffer_holding_them():
    layer = GrowingLayer()
    layer.update(*kv(5, 1.0))
    replaced_k, replaced_v = kv(7, 3.0)
    layer.keys, layer.values = replaced_k, replaced_v  # what engine.blend does after its pass
    keys, values = layer.update(*kv(1, 4.0))
    assert keys.shape[2] == 8
    assert torch.equal(keys[:, :, :7], replaced_k) and torch.equal(values[:, :, :7], replaced_v)
    assert torch.equal(keys[:, :, 7], torch.full((1, 2, 4), 4.0))
    assert torch.equal(replaced_k, torch.full((1, 2, 7, 4), 3.0))  # the assigned tensors are not written to


def test_a_crop_then_an_update_overwrites_the_cropped_positions_only():
    layer = GrowingLayer()
    layer.update(*kv(6, 1.0))
    layer.crop(-2)
    assert layer.get_seq_length() == 4
    keys, _ = layer.update(*kv(1, 5.0))
    assert keys.shape[2] == 5
    assert torch.equal(keys[:, :, :4], torch.full((1, 2, 4, 4), 1.0))
    assert torch.equal(keys[:, :, 4], torch.full((1, 2, 4), 5.0))


def test_a_reset_layer_starts_empty():
    cache = GrowingCache()
    cache.update(*kv(4, 1.0), 0)
    cache.reset()
    cache.update(*kv(2, 7.0), 0)
    assert cache.get_seq_length() == 2
    assert torch.equal(cache.layers[0].keys, torch.full((1, 2, 2, 4), 7.0))


def test_the_engine_decodes_over_a_growing_cache_without_a_kv_budget():
    model = build_model("llama")
    assert isinstance(make_cache(model, None), GrowingCache)


@torch.inference_mode()
def test_reserved_positions_extend_the_views_and_keep_what_was_written(monkeypatch):
    """reserve() (the one-call forward's growth, whose C code writes the values) extends keys and values like an
    update, across a growth and after a crop, without touching the positions already filled."""
    monkeypatch.setattr(live_cache, "BLOCK_TOKENS", 8)
    cache = GrowingCache()
    first = torch.randn(1, 2, 5, 4)
    cache.update(first, first + 1, 0)
    like = torch.empty(1, 2, 0, 4)
    (keys, values), = cache.reserve(1, 6, like)  # 11 positions: past the first block of 8 (+1 room)
    layer = cache.layers[0]
    assert layer.keys.shape[-2] == layer.values.shape[-2] == 11 == cache.get_seq_length()
    assert keys.data_ptr() == layer.keys.data_ptr() and keys.shape[-2] >= 12
    keys[:, :, 5:11] = 7.0  # what the C call would write
    assert torch.equal(layer.keys[:, :, :5], first) and torch.equal(layer.values[:, :, :5], first + 1)
    assert bool((layer.keys[:, :, 5:] == 7.0).all())
    layer.crop(-3)  # 8 positions left, as a view someone assigned
    cache.reserve(1, 2, like)
    assert layer.keys.shape[-2] == 10 and torch.equal(layer.keys[:, :, :5], first)


def test_a_grow_copies_every_position_in_pieces_and_nothing_past_them():
    """A grown buffer gets the old positions in pieces small enough for torch to copy on one thread (a layer of
    the embedded model at 2000 tokens: 12 pieces); each is copied whole and nothing past the last is written."""
    source_buffer = torch.randn(1, 3, 2100, 64)
    source = source_buffer[:, :, :2000]  # a prefix view, as a layer's keys are
    target = torch.full((1, 3, 2304, 64), 7.0)
    live_cache.copy_positions(target, source)
    assert torch.equal(target[:, :, :2000], source)
    assert bool((target[:, :, 2000:] == 7.0).all())
    assert (2000 * 3 * 64) // live_cache.SERIAL_COPY_VALUES >= 10  # the case does take many pieces


@torch.inference_mode()
def test_advance_extends_in_place_only_where_reserve_would_need_nothing_new(monkeypatch):
    """advance() (a decode step's growth where the one-call forward holds the buffers' addresses) counts positions
    in the buffers the layers have, and refuses, changing nothing, where reserve() would have to do more: a layer
    whose keys were assigned from outside (the CacheBlend pass does), a buffer without room, a layer not made yet.
    The generations change exactly where the buffers or what the keys are change."""
    monkeypatch.setattr(live_cache, "BLOCK_TOKENS", 8)
    cache = GrowingCache()
    like = torch.empty(1, 2, 0, 4)
    assert not cache.advance(2, 1) and cache.get_seq_length() == 0  # no layers yet
    buffers = cache.reserve(2, 3, like)  # 3 positions in buffers of 8
    start = cache.generations(2)
    assert cache.advance(2, 4) and cache.get_seq_length() == 7 and cache.generations(2) == start
    assert [layer.keys.shape[-2] for layer in cache.layers] == [7, 7]
    assert all(layer.keys.data_ptr() == keys.data_ptr() for layer, (keys, _) in zip(cache.layers, buffers))
    assert not cache.advance(2, 2) and cache.get_seq_length() == 7  # 9 > 8: a new buffer is reserve's to make
    cut = cache.layers[1]  # layer 1's keys are now a view assigned from outside, one position shorter
    cut.keys, cut.values = cut.keys[:, :, :-1], cut.values[:, :, :-1]
    assert cache.generations(2)[1] != start[1] and cache.generations(2)[0] == start[0]
    assert not cache.advance(2, 1) and [layer.keys.shape[-2] for layer in cache.layers] == [7, 6]
    cache.reserve(2, 2, like)  # layer 0: 9 > 8, a grow; layer 1: back in its buffer, 8 (full)
    grown = cache.generations(2)
    assert grown[0] != start[0] and [layer.keys.shape[-2] for layer in cache.layers] == [9, 8]
    assert not cache.advance(2, 1) and cache.generations(2) == grown  # layer 1 has no room left
    cache.reserve(2, 1, like)
    after = cache.generations(2)
    assert after[0] == grown[0] and after[1] != grown[1]  # layer 1 grown, layer 0 written in place
    assert cache.advance(2, 2) and cache.generations(2) == after
    assert [layer.keys.shape[-2] for layer in cache.layers] == [12, 11]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@torch.inference_mode()
def test_a_prefix_appended_at_once_decodes_as_one_updated_layer_by_layer(arch):
    """What a request reusing a stored prefix does (append); the same cache as transformers' updates build: the
    same values, lengths, dtype and device, and the next positions' logits bit for bit."""
    model = build_model(arch)
    ids = random_ids(41, seed=3)
    source = DynamicCache()
    model(input_ids=torch.tensor([ids[:33]]), past_key_values=source, use_cache=True)
    prefix = [(layer.keys.clone(), layer.values.clone()) for layer in source.layers]
    updated, appended = GrowingCache(), GrowingCache()
    for index, (keys, values) in enumerate(prefix):
        updated.update(keys, values, index)
    appended.append(prefix)
    assert appended.get_seq_length() == updated.get_seq_length() == 33
    for mine, theirs in zip(appended.layers, updated.layers, strict=True):
        assert mine.is_initialized and (mine.dtype, mine.device) == (theirs.dtype, theirs.device)
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
        assert mine._is_prefix_view() and mine.capacity_bytes() == theirs.capacity_bytes()
    for cache in (updated, appended):
        out = model(input_ids=torch.tensor([ids[33:]]), past_key_values=cache, use_cache=True)
        cache.logits = out.logits
    assert torch.equal(appended.logits, updated.logits)
    assert len(prefix) >= 2
    appended.append(prefix[:1])  # a layer that holds positions takes an update
    assert appended.layers[0].get_seq_length() == 41 + 33 and appended.layers[1].get_seq_length() == 41
    assert torch.equal(appended.layers[0].keys[:, :, 41:], prefix[0][0])
    with pytest.raises(ValueError, match="empty layer"):
        appended.layers[0].fill(*prefix[0])


def test_the_filled_length_is_the_views_length_in_every_state_a_layer_passes():
    """get_seq_length reads a count where keys are the buffers' filled part: it must say what the view's length
    says (DynamicLayer's answer) after updates, reservations, a crop, keys assigned from outside, a reset."""
    from transformers.cache_utils import DynamicLayer

    layer = GrowingLayer()

    def agrees():
        return layer.get_seq_length() == DynamicLayer.get_seq_length(layer)

    seen = [agrees()]
    layer.update(*kv(5, 1.0))
    seen.append(agrees())
    layer.reserve(3, kv(1, 0.0)[0])
    seen.append(agrees())
    layer.crop(-2)
    seen.append(agrees())
    layer.keys, layer.values = kv(9, 3.0)  # from outside: its length, not the buffers' count
    seen.append(agrees() and layer.get_seq_length() == 9)
    layer.update(*kv(1, 4.0))
    seen.append(agrees() and layer.get_seq_length() == 10)
    layer.reset()
    seen.append(agrees() and layer.get_seq_length() == 0)
    assert all(seen), seen


def test_a_crop_of_the_buffers_filled_part_lowers_the_count_and_keeps_the_buffers():
    """Cutting back rejected drafts: where keys are the buffers' filled part, a crop leaves the buffers (and their
    generation: the one-call forward's arrays of their addresses stay good) and lowers the count; what is left,
    and what the next update writes, are what a DynamicLayer holds after the same calls."""
    from transformers.cache_utils import DynamicLayer

    layer, plain = GrowingLayer(), DynamicLayer()
    for target in (layer, plain):
        target.update(*kv(6, 1.0))
        target.update(*kv(3, 2.0))
    buffer, generation = layer._key_buffer, layer.generation
    layer.crop(-2), plain.crop(-2)
    assert layer._key_buffer is buffer and layer.generation == generation and layer.get_seq_length() == 7
    for target in (layer, plain):
        target.update(*kv(1, 5.0))
    assert layer._key_buffer is buffer
    assert torch.equal(layer.keys, plain.keys) and torch.equal(layer.values, plain.values)
    layer.crop(-20), plain.crop(-20)  # more than it holds: nothing left, as a DynamicLayer
    assert layer.get_seq_length() == plain.get_seq_length() == 0
    assert torch.equal(layer.keys, plain.keys)
