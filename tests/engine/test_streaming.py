"""Layer streaming: streamed int4 models compute the same logits bit for bit as resident ones (tiny AWQ checkpoints
and the real model), the copies keep their order (a recording copy engine), the planner's arithmetic, and the
CPU copy engine's memory-mapped layer file."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from awq_checkpoints import write_awq_checkpoint
from tiny_models import ARCHS, COMMON, random_ids
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, Qwen2Config

from engine.weights.copy_engines import CpuCopyEngine, CudaCopyEngine
from engine.weights.int4 import Int4Linear, quantize_model
from engine.weights.loader import load_model, resolve_source
from engine.weights.streaming import decoder_layers, enable_streaming, layer_image, layer_layout, plan_streaming

CPU = torch.device("cpu")
NUM_LAYERS = 6  # more layers than slots, so slots are reused within a pass
DEEP = {"llama6": lambda: LlamaConfig(**{**COMMON, "num_hidden_layers": NUM_LAYERS}),
        "qwen2_6": lambda: Qwen2Config(**{**COMMON, "num_hidden_layers": NUM_LAYERS})}  # qwen2: q/k/v biases
HUGE = 1 << 50


@pytest.fixture(scope="module")
def awq_folders(tmp_path_factory):
    """Tiny AWQ checkpoints of six-layer llama and qwen2, written by tests/support/awq_checkpoints.py."""
    root = tmp_path_factory.mktemp("awq-streaming")
    with pytest.MonkeyPatch.context() as patch:
        for arch, make_config in DEEP.items():
            patch.setitem(ARCHS, arch, (make_config, "sdpa"))
            write_awq_checkpoint(root / arch, arch, 32)
    return {arch: root / arch for arch in DEEP}


def load(folder: Path, device: torch.device = CPU):
    model, _ = load_model(resolve_source(str(folder)), device, torch.float32, weights="int4")
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 7 * NUM_LAYERS
    return model


def plan_for(model, num_slots: int, extra_layers: int = 0):
    """The plan at the smallest budget (every layer streams), or with room for `extra_layers` more resident."""
    minimum = plan_streaming(model, HUGE, num_slots=num_slots, activation_bytes=0).min_budget_bytes
    layer_bytes = layer_layout(decoder_layers(model)[0]).tensor_bytes
    return plan_streaming(model, minimum + extra_layers * layer_bytes, num_slots=num_slots, activation_bytes=0)


@torch.inference_mode()
def greedy_logits(model, ids: list[int], num_steps: int, device: torch.device = CPU) -> list[torch.Tensor]:
    """Logits of a prefill of `ids` and of `num_steps` greedy decode steps after it, with a DynamicCache."""
    cache = DynamicCache()
    out = model(input_ids=torch.tensor([ids], device=device), past_key_values=cache, use_cache=True)
    logits = [out.logits]
    for _ in range(num_steps):
        out = model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
        logits.append(out.logits)
    return logits


def layer_bytes(layer) -> int:
    held = {id(t): t for t in [*layer.parameters(), *layer.buffers()]}
    return sum(t.numel() * t.element_size() for t in held.values())


# -- the same numbers --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", list(DEEP))
@pytest.mark.parametrize("num_slots, extra_layers", [(2, 0), (3, 0), (2, 2)])
def test_a_streamed_tiny_awq_model_gives_the_resident_logits_bit_for_bit(awq_folders, arch, num_slots, extra_layers,
                                                                          tmp_path, one_thread):
    resident = load(awq_folders[arch])
    model = copy.deepcopy(resident)
    plan = plan_for(model, num_slots, extra_layers)
    assert len(plan.streamed_layers) == NUM_LAYERS - extra_layers
    streamer = enable_streaming(model, plan, CpuCopyEngine(tmp_path, num_slots))
    ids = random_ids(21, seed=3)
    want = greedy_logits(resident, ids, 4)
    got = greedy_logits(model, ids, 4)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    stats = streamer.stats()
    assert stats["weight_passes"] == 5 and stats["tokens"] == 21 + 4 and stats["tokens_per_pass"] == 25 / 5
    # every pass copies each streamed layer once; the last pass also prefetched the first num_slots of the next
    assert stats["copies"] == 5 * len(plan.streamed_layers) + num_slots
    streamer.disable()  # everything resident again, with the same values
    assert all(torch.equal(g, w) for g, w in zip(greedy_logits(model, ids, 4), want))
    assert not list(tmp_path.iterdir())  # the layer file is gone


@pytest.fixture(scope="session")
def smollm_int4_model(smollm_float):
    """The session's real model (SmolLM2-135M, 30 layers) with int4 decoder linears (RTN, group 64): a copy of
    the weights the `smollm_float` fixture loaded, so the model is read from disk once per session."""
    model = copy.deepcopy(smollm_float.model)
    quantize_model(model, group_size=64)
    return model


def test_the_real_int4_model_streamed_through_two_slots_gives_the_resident_logits(smollm_float, smollm_int4_model,
                                                                                  tmp_path, one_thread):
    model = copy.deepcopy(smollm_int4_model)
    plan = plan_for(model, 2)
    assert len(plan.streamed_layers) == 30
    streamer = enable_streaming(model, plan, CpuCopyEngine(tmp_path, 2))
    ids = smollm_float.tokenizer("The capital of France is a city on the Seine, and its name is")["input_ids"]
    want = greedy_logits(smollm_int4_model, ids, 4)
    got = greedy_logits(model, ids, 4)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert streamer.stats()["copies"] == 5 * 30 + 2
    # the slots hold two layers where the resident model holds thirty
    assert streamer.resident_bytes() == plan.always_resident_bytes + 2 * plan.slot_bytes
    assert streamer.resident_bytes() < plan.always_resident_bytes + plan.streamed_bytes / 10


# -- the order of copies -----------------------------------------------------------------------------------------

class RecordingCopyEngine(CpuCopyEngine):
    """A CPU copy engine that logs every issue, wait and release (the test adds compute events)."""

    def __init__(self, folder, num_slots):
        super().__init__(folder, num_slots)
        self.log: list[tuple] = []
        self.occupant: list[int | None] = [None] * num_slots  # the layer each slot's bytes are

    def issue(self, layer, slot):
        self.log.append(("issue", layer, slot))
        super().issue(layer, slot)
        self.occupant[slot] = layer

    def wait(self, slot):
        self.log.append(("wait", slot))
        super().wait(slot)

    def release(self, slot):
        self.log.append(("release", slot))
        super().release(slot)


def inside(tensor: torch.Tensor, region: torch.Tensor) -> bool:
    start = region.data_ptr()
    return start <= tensor.data_ptr() and tensor.data_ptr() + tensor.numel() * tensor.element_size() <= \
        start + region.numel()


@pytest.mark.parametrize("num_slots", [2, 3])
def test_copies_run_ahead_of_compute_and_never_overwrite_a_layer_before_it_has_run(awq_folders, num_slots,
                                                                                   tmp_path, one_thread):
    model = load(awq_folders["llama6"])
    plan = plan_for(model, num_slots, extra_layers=1)
    order = list(plan.streamed_layers)
    assert len(order) == NUM_LAYERS - 1 > num_slots
    engine = RecordingCopyEngine(tmp_path, num_slots)
    streamer = enable_streaming(model, plan, engine)
    layers = decoder_layers(model)

    def in_slots(index: int) -> bool:
        return any(inside(t, engine.slot(s)) for t in layers[index].buffers() for s in range(num_slots))

    def on_compute(index):
        def hook(module, args):
            engine.log.append(("compute", index))
            if index in order:  # the layer runs on views of the slot its last issue filled
                slot = next(e[2] for e in reversed(engine.log) if e[0] == "issue" and e[1] == index)
                assert engine.occupant[slot] == index
                assert all(inside(t, engine.slot(slot)) for t in [*module.parameters(), *module.buffers()])
                # at most num_slots streamed layers in RAM, and only the one computing is viewed there
                assert len(set(engine.occupant)) == num_slots
                assert [i for i in order if in_slots(i)] == [index]
        return hook

    def on_computed(index):
        return lambda module, args, output: engine.log.append(("computed", index))

    for index, layer in enumerate(layers):  # compute hooks run just inside the streamer's
        layer.register_forward_pre_hook(on_compute(index))
        layer.register_forward_hook(on_computed(index), prepend=True)
    num_forwards = 4
    greedy_logits(model, random_ids(9, seed=5), num_forwards - 1)
    log = engine.log

    computes = [i for i, e in enumerate(log) if e[0] == "compute" and e[1] in order]
    assert [log[i][1] for i in computes] == order * num_forwards
    for at in computes:
        layer = log[at][1]
        following = order[(order.index(layer) + 1) % len(order)]
        last_run = max((i for i, e in enumerate(log[:at]) if e == ("compute", following)), default=-1)
        # the next streamed layer's copy was issued after its previous use and before this layer computes
        assert any(e[:2] == ("issue", following) for e in log[last_run + 1:at]), (layer, following)
    issues = [i for i, e in enumerate(log) if e[0] == "issue"]
    for slot in range(num_slots):
        into = [i for i in issues if log[i][2] == slot]
        for earlier, later in zip(into, into[1:]):
            occupant = log[earlier][1]
            between = log[earlier + 1:later]
            # a slot is filled again only after its occupant ran and the slot was released after that
            assert ("computed", occupant) in between
            done = between.index(("computed", occupant))
            assert ("release", slot) in between[done:]
    copies = {layer: sum(e[:2] == ("issue", layer) for e in log) for layer in order}
    # one copy per layer per pass; the first num_slots layers once more, prefetched for a pass to come
    assert copies == {layer: num_forwards + (p < num_slots) for p, layer in enumerate(order)}
    assert streamer.stats()["copies"] == sum(copies.values())
    assert streamer.stats()["bytes_copied"] == sum(n * streamer.layouts[layer].image_bytes
                                                  for layer, n in copies.items())
    assert streamer.resident_bytes() == plan.always_resident_bytes + plan.resident_bytes + num_slots * plan.slot_bytes


# -- the planner -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_int4():
    """A six-layer tiny llama with int4 decoder linears (RTN at load): the planner only reads its sizes."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(DEEP["llama6"](), dtype=torch.float32).eval()
    quantize_model(model, group_size=32, kernel="reference")
    return model


def test_a_budget_below_the_minimum_is_an_error_naming_it(tiny_int4):
    plan = plan_streaming(tiny_int4, HUGE, num_slots=2, kv_bytes=1000, activation_bytes=5000)
    minimum = plan.min_budget_bytes
    largest = max(layer_layout(layer).image_bytes for layer in decoder_layers(tiny_int4))
    assert minimum == plan.always_resident_bytes + 2 * largest + 6000
    with pytest.raises(ValueError, match=rf"minimum of {minimum} bytes \({minimum / (1 << 20):.1f} MiB\)"):
        plan_streaming(tiny_int4, minimum - 1, num_slots=2, kv_bytes=1000, activation_bytes=5000)
    at_minimum = plan_streaming(tiny_int4, minimum, num_slots=2, kv_bytes=1000, activation_bytes=5000)
    assert at_minimum.streamed_layers == tuple(range(NUM_LAYERS)) and at_minimum.device_bytes == minimum


def test_a_budget_that_holds_everything_streams_nothing(tiny_int4):
    everything = plan_streaming(tiny_int4, HUGE, activation_bytes=0)
    need = everything.always_resident_bytes + everything.resident_bytes
    plan = plan_streaming(tiny_int4, need, activation_bytes=0)
    assert not plan.streams and plan.streamed_layers == () and plan.slot_bytes == 0
    assert plan.resident_layers == tuple(range(NUM_LAYERS)) and plan.device_bytes == need == everything.device_bytes
    assert plan_streaming(tiny_int4, need - 1, activation_bytes=0).streams


def test_resident_and_streamed_bytes_add_up_and_more_budget_keeps_more_layers(tiny_int4):
    layers = decoder_layers(tiny_int4)
    decoder = sum(layer_bytes(layer) for layer in layers)
    outside = {id(t): t for t in [*tiny_int4.parameters(), *tiny_int4.buffers()]}
    for layer in layers:
        for t in [*layer.parameters(), *layer.buffers()]:
            outside.pop(id(t), None)
    minimum = plan_streaming(tiny_int4, HUGE, num_slots=3, activation_bytes=0).min_budget_bytes
    previous = -1
    for budget in range(minimum, minimum + decoder + 1, decoder // 25):
        plan = plan_streaming(tiny_int4, budget, num_slots=3, activation_bytes=0)
        assert plan.resident_bytes + plan.streamed_bytes == decoder
        assert plan.always_resident_bytes == sum(t.numel() * t.element_size() for t in outside.values())
        assert sorted(plan.resident_layers + plan.streamed_layers) == list(range(NUM_LAYERS))
        assert plan.device_bytes <= budget
        assert len(plan.resident_layers) >= previous
        previous = len(plan.resident_layers)
    assert previous == NUM_LAYERS


def test_streamed_layers_are_spread_over_the_stack(tiny_int4):
    layer = layer_layout(decoder_layers(tiny_int4)[0]).tensor_bytes
    minimum = plan_streaming(tiny_int4, HUGE, num_slots=2, activation_bytes=0).min_budget_bytes
    plan = plan_streaming(tiny_int4, minimum + 3 * layer, num_slots=2, activation_bytes=0)
    assert plan.streamed_layers == (1, 3, 5)  # not three in a row: copies overlap the resident layers between


def test_a_layer_that_cannot_stream_is_refused_before_anything_moves(tiny_int4, tmp_path):
    model = copy.deepcopy(tiny_int4)
    plan = plan_for(model, 2)
    attention = decoder_layers(model)[3].self_attn
    attention.cached = attention.q_proj.packed  # a tensor outside the parameters and buffers: never in a slot
    with pytest.raises(ValueError, match="layer 3 holds a tensor outside its parameters and buffers"):
        enable_streaming(model, plan, CpuCopyEngine(tmp_path, 2))
    del attention.cached
    decoder_layers(model)[2].mlp.up_proj.bias = model.model.norm.weight  # shared with an always-resident norm
    with pytest.raises(ValueError, match="layer 2 shares a tensor with the rest of the model"):
        enable_streaming(model, plan, CpuCopyEngine(tmp_path, 2))
    with pytest.raises(ValueError, match="the plan is for 2 slots, the copy engine has 3"):
        enable_streaming(model, plan, CpuCopyEngine(tmp_path, 3))
    assert not list(tmp_path.iterdir())  # refused before the layer file was made


# -- the layer file ----------------------------------------------------------------------------------------------

def mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """Address ranges this process maps from `path` (Linux: /proc/self/maps)."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip().removesuffix(" (deleted)") == str(path):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's mappings from /proc")
def test_streamed_layers_live_in_a_mapped_file_and_round_trip_byte_for_byte(awq_folders, tmp_path, one_thread):
    model = load(awq_folders["qwen2_6"])
    original = copy.deepcopy(model)
    plan = plan_for(model, 2, extra_layers=2)
    engine = CpuCopyEngine(tmp_path, 2)
    streamer = enable_streaming(model, plan, engine)
    ranges = mapped_ranges(engine.path)
    assert ranges, "the layer file is not mapped"
    layers = decoder_layers(model)

    def file_backed(t: torch.Tensor) -> bool:
        return any(start <= t.data_ptr() < end for start, end in ranges)

    raw = engine.path.read_bytes()
    for index in plan.streamed_layers:
        layout = layer_layout(decoder_layers(original)[index])
        image = layer_image(decoder_layers(original)[index], layout)
        held = [*layers[index].parameters(), *layers[index].buffers()]
        assert held and all(file_backed(t) for t in held)  # no RAM copy of the layer: its tensors are the file's
        assert file_backed(engine.host(index))
        offset, size = engine.region(index)
        assert bytes(raw[offset:offset + size]) == image.numpy().tobytes()
        engine.issue(index, 0)
        assert torch.equal(engine.slot(0)[:size], image)
        for (name, want), (_, got) in zip(decoder_layers(original)[index].state_dict().items(),
                                          layers[index].state_dict().items()):
            assert got.dtype == want.dtype and torch.equal(got, want), name
    for index in plan.resident_layers:
        assert not any(file_backed(t) for t in [*layers[index].parameters(), *layers[index].buffers()])
    assert streamer.resident_bytes() == plan.always_resident_bytes + plan.resident_bytes + 2 * plan.slot_bytes
    assert plan.streamed_bytes == sum(layer_bytes(decoder_layers(original)[i]) for i in plan.streamed_layers)


# -- CUDA --------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("num_slots", [2, 3])
def test_a_model_streamed_from_pinned_memory_on_cuda_gives_the_resident_logits(awq_folders, num_slots):
    cuda = torch.device("cuda")
    resident = load(awq_folders["llama6"], cuda)
    model = copy.deepcopy(resident)
    plan = plan_for(model, num_slots, extra_layers=1)
    engine = CudaCopyEngine(cuda, num_slots)
    streamer = enable_streaming(model, plan, engine)
    assert all(engine.host(i).is_pinned() for i in plan.streamed_layers)
    ids = random_ids(33, seed=8)
    want = greedy_logits(resident, ids, 4, cuda)
    got = greedy_logits(model, ids, 4, cuda)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert streamer.stats()["copies"] == 5 * len(plan.streamed_layers) + num_slots
    assert streamer.resident_bytes() == plan.always_resident_bytes + plan.resident_bytes + num_slots * plan.slot_bytes
    streamer.disable()
    assert all(torch.equal(g, w) for g, w in zip(greedy_logits(model, ids, 4, cuda), want))


def test_the_default_load_streamed_runs_its_layers_through_the_slots(smollm, tmp_path):
    """The embedded model as auto loads it (int4 layers, or the file's blocks, whose one-call forward would read
    every layer in place): streamed under a budget that keeps some layers out, every pass copies them in, and the
    answer is the resident one."""
    from engine import KVBoost

    streamed = KVBoost.from_pretrained(device="cpu", disk_cache_bytes=0, layer_streaming=True,
                                       weight_budget_bytes=270_000_000)
    plan = streamed.streaming.plan
    assert plan.streams and 0 < len(plan.streamed_layers) < 30
    question = [{"role": "user", "content": "What is the capital of France?"}]
    want = smollm.with_options(speculative=None).chat(question, max_new_tokens=8)
    got = streamed.with_options(speculative=None).chat(question, max_new_tokens=8)
    assert got.token_ids == want.token_ids
    assert got.stats.weight_passes == got.stats.decode_forwards + 1  # the prompt's pass, then one per token
    assert streamed.info().layer_streaming_unavailable is None  # a quantized load can stream
