"""What runs an engine's model: one request, or one batched step, at a time.

A `ModelRunner` holds the lock that every use of the model takes (a request alone holds it from its first step
to its Result; a Batch holds the locks of its engines for each step) and runs a request's Forward: a one-token
step replayed from the CUDA graph where it can run (engine.graph_decode), else the plain forward
(engine.generate.run_forward). The facade (engine.engine) makes one per engine; the batching layer
(engine.batching) and the worker use nothing else of the facade to run models.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from .batching import Forward
from .generate import run_forward
from .prefill import prompt_forward


class ModelRunner:
    def __init__(self, model, device: torch.device, graph_step=None):
        self.model = model
        self.device = device
        self.graph_step = graph_step  # a GraphDecode, or None
        self.lock = threading.Lock()
        self._owner: int | None = None

    def forward(self, forward: Forward) -> torch.Tensor:
        """A Forward of one request run by itself: a prompt piece (engine.prefill.prompt_forward), or a decode step,
        one token from the CUDA graph where it can run."""
        if forward.prompt:
            return prompt_forward(self.model, forward, self.device)
        if self.graph_step is not None and len(forward.tokens) == 1 and not forward.prompt:
            logits = self.graph_step(forward.tokens[0], forward.cache)
            if logits is not None:
                return logits[None]
        return run_forward(self.model, forward, self.device)

    @contextlib.contextmanager
    def one_request(self):
        """The model for one request, from its first step to its end. A second request opened and iterated on
        the thread that holds the first would wait for itself forever: that is a RuntimeError."""
        if self._owner == threading.get_ident():
            raise RuntimeError("a stream is still open on this engine in this thread; finish or close it first")
        with self.lock:
            self._owner = threading.get_ident()
            try:
                yield
            finally:
                self._owner = None
