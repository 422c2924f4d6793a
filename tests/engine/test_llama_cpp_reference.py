"""The same GGUF file through llama.cpp and through this project's loader gives the same first-token logits.

llama.cpp is an independent reading of the format: its own block decoders, its own q/k handling, its own
kernels. It runs in a child process (llama-cpp-python and torch in one process crash), found as
KVBOOST_LLAMA_PYTHON or this interpreter when it can import llama_cpp; the tests skip where there is neither.

The bound. llama.cpp's CPU kernels round the activations to 8 bits per block of 32 (Q8_0 / Q8_1 / Q8_K) before
each quantized dot product; our float path does not round them, our int4 kernels round them to bfloat16 (8
bits of mantissa). Roundings of that size add up over the layers to a few percent of the logits' spread: our
own float and int4 loads of the embedded model differ by 2-4% (relative RMS of the mean-removed logits, the
part a softmax sees). A misread block (a wrong scale, a nibble order, a missing row permutation) moves the
logits by the order of their own spread (100%). So: mean-removed relative RMS under 10%, KL divergence of the
next-token distributions under 0.05 nats, and each side's top token among the other's top three.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf_files import VOCAB, tiny_gguf

from engine.weights.loader import default_model_path, load_model, resolve_source

CPU = torch.device("cpu")
REL_RMS_BOUND = 0.10
KL_BOUND = 0.05

CHILD = r"""
import json, sys
import numpy as np
import llama_cpp
job = json.loads(sys.stdin.read())
llm = llama_cpp.Llama(job["path"], n_ctx=max(64, max(len(ids) for ids in job["prompts"]) + 8), n_threads=2,
                      n_batch=512, logits_all=True, verbose=False)
rows = []
for ids in job["prompts"]:
    llm.reset()
    llm.eval(ids)
    rows.append(np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64).tolist())
print(json.dumps(rows))
"""


def llama_python() -> str | None:
    chosen = os.environ.get("KVBOOST_LLAMA_PYTHON")
    if chosen:
        return chosen
    return sys.executable if importlib.util.find_spec("llama_cpp") is not None else None


def llama_cpp_logits(path, prompts: list[list[int]]) -> np.ndarray:
    python = llama_python()
    if python is None:
        pytest.skip("llama-cpp-python is not importable here (set KVBOOST_LLAMA_PYTHON to a Python that has it)")
    done = subprocess.run([python, "-c", CHILD], input=json.dumps({"path": str(path), "prompts": prompts}),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return np.array(json.loads(done.stdout))


def our_logits(model, prompts: list[list[int]]) -> np.ndarray:
    with torch.inference_mode():
        return np.stack([model(torch.tensor([ids])).logits[0, -1].double().numpy() for ids in prompts])


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def assert_agree(ours: np.ndarray, theirs: np.ndarray) -> None:
    for i, (a, b) in enumerate(zip(ours, theirs)):
        ca, cb = a - a.mean(), b - b.mean()
        rel = np.linalg.norm(ca - cb) / np.linalg.norm(cb)
        assert rel < REL_RMS_BOUND, f"prompt {i}: logits {rel:.1%} apart (relative RMS, means removed)"
        kl = float((np.exp(log_softmax(b)) * (log_softmax(b) - log_softmax(a))).sum())
        assert kl < KL_BOUND, f"prompt {i}: KL(llama.cpp || ours) = {kl:.4f}"
        assert int(np.argmax(a)) in np.argsort(-b)[:3] and int(np.argmax(b)) in np.argsort(-a)[:3], f"prompt {i}"


@pytest.mark.parametrize("weights", ["float", "auto"])
def test_the_embedded_model_gives_llama_cpps_first_token_logits(smollm, weights, one_thread):
    texts = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,",
             "Water boils at a temperature of"]
    prompts = [smollm.tokenizer(t)["input_ids"] for t in texts]
    theirs = llama_cpp_logits(default_model_path(), prompts)
    model = smollm.model if weights == "auto" else \
        load_model(resolve_source(None), CPU, torch.float32, weights="float")[0]
    assert_agree(our_logits(model, prompts), theirs)


# weights="int4" takes 4-bit codes as they are and 5-8-bit ones as int8 rows; an F16 file under int4 is a second
# rounding (RTN), not the file's values, so it is compared under float only.
TYPES = ["Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "F16"]


@pytest.mark.parametrize(("linear_type", "weights"),
                         [(t, "float") for t in TYPES] + [(t, "int4") for t in TYPES if t != "F16"])
def test_each_gguf_type_gives_llama_cpps_first_token_logits(tmp_path, linear_type, weights, one_thread):
    path = tiny_gguf(tmp_path / f"tiny-{linear_type}.gguf", linear_type, table_type="Q8_0", tied=False, seed=3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, VOCAB, size=n).tolist() for n in (5, 17, 40)]
    theirs = llama_cpp_logits(path, prompts)
    model = load_model(resolve_source(str(path)), CPU, torch.float32, weights=weights)[0]
    assert_agree(our_logits(model, prompts), theirs)
