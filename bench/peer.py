"""A published peer library as an extra bench row: the PyPI package `kvboost` (import name `kvboost`, a
different project from ours, which is `engine` / `kvboost-desktop`), run on the same prompts, on the same
loaded weights.

The peer is optional and never a dependency. Install it beside our venv without touching its packages:

    pip install --no-deps --target /tmp/peer-kvboost kvboost==0.9.0
    export KVBOOST_PEER_PATH=/tmp/peer-kvboost

(its own requirements torch, transformers and accelerate are ours already; it imports no sentencepiece).

How the peer is driven (kvboost 0.9.0, `kvboost.engine.InferenceEngine`, exported as `kvboost.KVBoost`):

- Its constructor takes an already-loaded `model` and `tokenizer` (`from_pretrained` only adds loading by
  hub id, which our GGUF-dequantized model cannot use), so it wraps `base_engine.model` and
  `base_engine.tokenizer` directly: same weights, same dtype, same device.
- A request is `generate(prompt_text, max_new_tokens, mode=CHUNK_KV_REUSE, do_sample=False)`: greedy
  argmax. Its default strategy is used: fixed 128-token chunks keyed by a chained (prefix) hash with a
  content-only hash as fallback, only the leading contiguous run of matched chunks reused, "selective"
  seam repair (the last 16 tokens before each seam recomputed), approximate (content-hash) matches
  forcing CacheBlend. After each request it stores the prompt's new chunks itself (after the answer, so
  outside TTFT), which is how "seeing the documents first" works; `warm(text)` does the same without
  generating.
- Glue, two pieces, both so that its tokens equal ours: (1) its `_encode` is `tokenizer.encode(text,
  add_special_tokens=True)`, which would add a second BOS on tokenizers that add one (the chat template
  already holds it); the instance's `_encode` is replaced by our engine's encoding of a rendered prompt
  (`add_special_tokens=False`). (2) It stops only at `tokenizer.eos_token_id` and counts that token as
  generated; its ids are cut at the first of our engine's EOS ids, which ours never reports.
- TTFT is timed by us, from entering `PeerEngine.chat` (chat template rendering included, as ours includes
  encoding) to the first sampled token, which the peer hands to its `on_token` callback right after its
  argmax. That window holds all of its tokenization, chunk lookup, KV merge and device moves, seam repair
  and live prefill. (Its own `GenerationResult.ttft_ms` starts only after lookup and repair; it is kept
  as `peer_reported_ttft_ms` for reference, not used.)

Caveats: the peer temporarily swaps `model.lm_head` during its forwards (its `last_logit_only`), so never
run it concurrently with another engine on the same model. Its stored chunk KV is computed per chunk
without the preceding chunks as context, even for exact prefix-hash hits, so its reuse is approximate
everywhere past the first chunk (repaired only at seams).
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from typing import Sequence

PEER_PATH_ENV = "KVBOOST_PEER_PATH"
PEER_DIST = "kvboost"
INSTALL_HINT = (f"pip install --no-deps --target /tmp/peer-kvboost kvboost==0.9.0 and set "
                f"{PEER_PATH_ENV}=/tmp/peer-kvboost")

Messages = Sequence[dict]


class PeerUnavailable(RuntimeError):
    """The peer library cannot run here; str(exc) is a one-line reason."""


def _add_peer_path() -> None:
    folder = os.environ.get(PEER_PATH_ENV)
    if folder and folder not in sys.path:
        sys.path.insert(0, folder)
        importlib.invalidate_caches()


def _import_peer():
    _add_peer_path()
    import kvboost  # noqa: PLC0415  (optional, found at run time)

    if not hasattr(kvboost, "KVBoost") or not hasattr(kvboost, "GenerationMode"):
        raise ImportError(f"the 'kvboost' at {getattr(kvboost, '__file__', '?')} is not the PyPI kvboost "
                          "(no KVBoost/GenerationMode)")
    return kvboost


def peer_version() -> str:
    """The installed distribution's version (its `__version__` attribute lags: 0.9.0 says "0.7.0")."""
    _add_peer_path()
    try:
        from importlib.metadata import version

        return version(PEER_DIST)
    except Exception:  # noqa: BLE001
        return "unknown"


def peer_available() -> str | None:
    """None when `import kvboost` works (after prepending $KVBOOST_PEER_PATH to sys.path, if set), else a
    one-line reason."""
    try:
        _import_peer()
    except Exception as exc:  # noqa: BLE001  (any import failure is a reason, not a crash)
        first = str(exc).splitlines()[0] if str(exc) else ""
        where = os.environ.get(PEER_PATH_ENV)
        path_note = f" ({PEER_PATH_ENV}={where})" if where else f" ({PEER_PATH_ENV} not set)"
        return f"peer 'kvboost' not importable{path_note}: {type(exc).__name__}: {first}; {INSTALL_HINT}"
    return None


class PeerEngine:
    """The peer library wrapped over our engine's loaded model and tokenizer.

    `chat(messages, max_new_tokens) -> (text, token_ids, ttft_ms, reused_tokens)`: the prompt is rendered
    with our tokenizer's chat template exactly as our engine renders it, so prompt text and token ids are
    identical to ours; decoding is greedy; `ttft_ms` runs from entering `chat` to the first sampled token
    (one call, via the peer's `on_token` callback: all its lookup, repair and prefill work is inside);
    `reused_tokens` is the peer's own `cached_tokens` (prompt tokens whose KV it took from its cache).
    Raises PeerUnavailable when the peer cannot be imported or refuses the model.
    """

    def __init__(self, base_engine, *, chunk_size: int = 128, recompute_strategy: str = "selective",
                 max_cache_bytes: int = 2 * 1024 ** 3):
        reason = peer_available()
        if reason is not None:
            raise PeerUnavailable(reason)
        kvboost = _import_peer()
        self._kvboost = kvboost
        self.base = base_engine
        self.tokenizer = base_engine.tokenizer
        self.version = peer_version()
        model = base_engine.model
        try:
            from kvboost.compat import check_model_compatibility

            check_model_compatibility(model, strict=True)
        except ValueError as exc:
            raise PeerUnavailable(f"peer kvboost {self.version} refuses this model: {exc}") from None
        except Exception:  # noqa: BLE001  (a missing helper or an "untested" warning is not a refusal)
            pass
        device = str(getattr(base_engine, "device", next(model.parameters()).device))
        try:
            # The constructor does model.to(device): a no-op here, the model is already on that device.
            self.peer = kvboost.KVBoost(model, self.tokenizer, max_cache_bytes=max_cache_bytes,
                                        chunk_size=chunk_size, recompute_strategy=recompute_strategy,
                                        device=device)
        except Exception as exc:  # noqa: BLE001
            raise PeerUnavailable(f"peer kvboost {self.version} cannot wrap the loaded model: "
                                  f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
        tokenizer = self.tokenizer
        # Glue 1: our encoding of a rendered prompt (the template holds any BOS), not encode(add_special_tokens=True).
        self.peer._encode = lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"])
        eos = getattr(base_engine, "_eos_ids", None)
        self.eos_ids: set[int] = set(eos) if eos else {tokenizer.eos_token_id}
        self.last_result = None  # the peer's GenerationResult of the last chat()
        self.settings = {"chunk_size": chunk_size, "recompute_strategy": recompute_strategy,
                         "mode": "chunk_kv_reuse", "version": self.version}

    def render(self, messages: Messages) -> str:
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)

    def prime(self, prompt: Messages | str) -> dict:
        """Lets the peer see a prompt (messages, rendered with the generation prompt as a request would be,
        or plain text) without generating: its `warm()`, which stores the text's 128-token chunks."""
        text = prompt if isinstance(prompt, str) else self.render(prompt)
        t0 = time.perf_counter()
        result = self.peer.warm(text)
        return {"chunks_stored": int(result.chunks_stored), "tokens": int(result.token_count),
                "ms": (time.perf_counter() - t0) * 1000}

    def reset(self) -> None:
        self.peer.reset_cache()

    def chat(self, messages: Messages, max_new_tokens: int) -> tuple[str, list[int], float, int | None]:
        t_enter = time.perf_counter()
        prompt = self.render(messages)
        ids: list[int] = []
        first: list[float] = []

        def on_token(token: int) -> None:
            if not first:
                first.append(time.perf_counter())
            ids.append(int(token))

        result = self.peer.generate(prompt, max_new_tokens=max_new_tokens,
                                    mode=self._kvboost.GenerationMode.CHUNK_KV_REUSE,
                                    temperature=1.0, do_sample=False, on_token=on_token)
        ttft_ms = (first[0] - t_enter) * 1000 if first else (time.perf_counter() - t_enter) * 1000
        self.last_result = result
        # Glue 2: cut at the first of our EOS ids (ours stops there and does not report it).
        cut = next((i for i, t in enumerate(ids) if t in self.eos_ids), len(ids))
        ids = ids[:cut]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        reused = getattr(result, "cached_tokens", None)
        return text, ids, ttft_ms, (int(reused) if reused is not None else None)


def run_peer_rows(base_engine, prompts: list[list[dict]], max_new_tokens: int,
                  reference_token_ids: list[list[int]], *, prime: Sequence[Messages | str] = (),
                  peer: PeerEngine | None = None, warm_up: bool = True) -> list[dict]:
    """One peer row per prompt, in order, on one peer instance (its cache carries over from prompt to
    prompt, like our engines' stores within a workload).

    Each row: ttft_ms (ours, from call entry), reused (the peer's cached_tokens, or None), first_token_agree
    and all_tokens_agree (greedy ids vs `reference_token_ids`, our reuse="off" output of the same prompt;
    both empty counts as agreeing), text; plus prompt_tokens, token_ids, total_ms (whole call, including the
    peer storing the prompt's new chunks after the answer), peer_reported_ttft_ms, reuse_ratio (the peer's
    kv_reuse_ratio). `prime`: prompts or texts the peer sees first (its warm(),
    untimed). `warm_up`: one tiny request and then an empty cache first, as bench.warm_up does for ours.
    Raises PeerUnavailable (one-line reason) when the peer cannot run.
    """
    if len(prompts) != len(reference_token_ids):
        raise ValueError(f"{len(prompts)} prompts but {len(reference_token_ids)} reference outputs")
    if peer is None:
        peer = PeerEngine(base_engine)
    if warm_up:
        peer.chat([{"role": "user", "content": "Say hi."}], max_new_tokens=2)
        peer.reset()
    for p in prime:
        peer.prime(p)
    rows = []
    for messages, reference in zip(prompts, reference_token_ids):
        t0 = time.perf_counter()
        text, ids, ttft_ms, reused = peer.chat(messages, max_new_tokens)
        total_ms = (time.perf_counter() - t0) * 1000
        result = peer.last_result
        reference = list(reference)
        rows.append({
            "ttft_ms": ttft_ms,
            "reused": reused,
            "first_token_agree": ids[:1] == reference[:1],
            "all_tokens_agree": ids == reference,
            "text": text,
            "prompt_tokens": int(getattr(result, "prompt_tokens", 0)),
            "token_ids": ids,
            "total_ms": total_ms,
            "peer_reported_ttft_ms": float(getattr(result, "ttft_ms", float("nan"))),
            "reuse_ratio": float(getattr(result, "kv_reuse_ratio", float("nan"))),
        })
    return rows


class PeerBenchEngine:
    """The peer behind the small part of our engine's interface that `bench.reuse` uses (generate, chat,
    warm, clear_cache), so it runs as one more mode, interleaved with ours on every prompt. It has no logits
    to compare: its KL is reported as NaN."""

    def __init__(self, base_engine):
        self.peer = PeerEngine(base_engine)

    def generate(self, messages: Messages, *, max_new_tokens: int, **_ignored):
        from engine.generate import Result, Stats

        text, ids, ttft_ms, reused = self.peer.chat(messages, max_new_tokens)
        result = self.peer.last_result
        prompt_tokens = int(getattr(result, "prompt_tokens", 0))
        stats = Stats(prompt_tokens=prompt_tokens, reused_tokens=int(reused or 0),
                      recomputed_tokens=prompt_tokens - int(reused or 0), generated_tokens=len(ids),
                      ttft_ms=ttft_ms, reuse=f"peer kvboost {self.peer.version}")
        return Result(text, ids, "stop" if len(ids) < max_new_tokens else "length", stats, None)

    chat = generate

    def warm(self, messages: Messages | str) -> dict:
        return self.peer.prime(messages)

    def clear_cache(self) -> None:
        self.peer.reset()
