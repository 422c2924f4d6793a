import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy machine their spin-waits cost up to
    50x per forward pass (measured: 1.5 ms vs 80 ms per decode step on 2 loaded cores)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def smollm_int4_engine(smollm_float):
    """An int4 copy of the session's real model (its head and table int8, as weights="int4" loads it), reuse and
    speculation off."""
    import copy

    from engine import EngineConfig, KVBoost
    from engine.weights.head import quantize_head
    from engine.weights.int4 import kernel_unavailable, quantize_model

    why = kernel_unavailable("cpu_int4pack", "cpu")
    if why is not None:  # torch builds without the CPU int4 kernel; this one has it, so the tests run here
        pytest.skip(f"no CPU int4 kernel: {why}")

    model = copy.deepcopy(smollm_float.model)
    quantize_model(model, group_size=64, kernel="cpu_int4pack")
    quantize_head(model, "int8+embedding")
    engine = KVBoost(model, smollm_float.tokenizer, EngineConfig.of(disk_cache_bytes=0, reuse="off", speculative=None))
    # A process's first request once, now and then, gave other logits than every later one: torch's first
    # vectorized cos() on fresh threads (engine.thread_math.settle_thread_math, tests/engine/test_first_request.py).
    # The request below stays: these tests compare warmed runs either way.
    engine.generate("Hello", max_new_tokens=2)
    return engine
