"""The facade users import: KVBoost.from_pretrained, generate, chat, stream, warm, info, memory, cache_stats.

A request runs in three steps, each a module of its own: plan and fetch (engine.reuse), prefill (engine.prefill),
decode (engine.generate); the facade stores what the prefill computed, after the first token and in `finally`.
The request is a coroutine (engine.batching): run alone by the RequestStream that stream() returns, or with
others in an EngineWorker's batch. Over 400 lines: the one facade class, its from_pretrained options documented
where they are taken.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import warnings
from typing import Iterator, Sequence

import torch

from .batching import Forward, RequestStream, batching_unavailable
from .blend import BLEND_MODEL_TYPES, blend_unavailable
from .block_forward import use_block_forward
from .chunking import TokenBreaks
from .config import EngineConfig, LoadOptions, SamplingConfig, split_options
from .config import options as config_options
from .draft_model import draft_model_mismatch
from .exact_attention import use_exact_attention
from .generate import Cancelled, Decoder, Result, Stats, TokenEvent, decode_tokens
from .graph_decode import GraphDecode, graph_decode_unavailable
from .keys import root_key
from .kv.tiered_store import build_store
from .paged import make_cache, spill_unsupported
from .prefill import PromptProgress, prefill_steps
from .prompt import Messages, encode
from .reports import CacheStats, ChunkingStats, EngineInfo, MemoryReport, RemoteTierStats, TierStats, WeightsReport
from .reuse import KVReuse
from .rope import rope_params, rotary_module
from .rotary_table import use_rotary_table
from .runner import ModelRunner
from .speculative import Spellings
from .thread_math import settle_thread_math
from .weights import loader
from .weights.fingerprint import fingerprint as model_fingerprint
from .weights.stream_setup import Streaming, load_for_streaming, start_streaming, streaming_refusal
from .weights.weights_report import weights_report


class UnsupportedModelError(ValueError):
    """A model this engine cannot serve correctly (no RoPE, ...)."""


def layer_streaming_unavailable(model_config, device: torch.device, weights: str = "auto") -> str | None:
    """Why layer streaming cannot run for a model of `model_config` loaded with `weights` on `device`, or None
    when it can (engine.weights.stream_setup.streaming_refusal)."""
    return streaming_refusal(model_config, device, weights)


def awq_streaming_unavailable(model_config, device: torch.device, weights: str = "auto") -> str | None:
    """The old name of layer_streaming_unavailable (streaming was first built for AWQ checkpoints; it streams
    any int4 or GGUF-block layers). Kept for one release."""
    warnings.warn("awq_streaming_unavailable is now layer_streaming_unavailable", DeprecationWarning, stacklevel=2)
    return layer_streaming_unavailable(model_config, device, weights)


def _load_steps(progress, cancel: threading.Event | None):
    """The loader's progress callback: `progress`'s, with the cancel event checked at every step (so a load
    stops within one decoder layer of being cancelled)."""
    def step(done: int, total: int, what: str) -> None:
        _check_cancel(cancel)
        if progress is not None:
            progress(done, total, what)
    return step


def _check_cancel(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise Cancelled("model load cancelled")


class KVBoost:
    def __init__(self, model, tokenizer, config: EngineConfig | None = None, *, fingerprint: str | None = None,
                 name: str = "model", streaming: Streaming | None = None, draft_model=None):
        config = config or EngineConfig()
        config.validate()
        if config.decode.speculative == "draft-model" and draft_model is None:
            raise ValueError("speculative='draft-model' needs a draft model (from_pretrained(draft_model=...))")
        if rotary_module(model) is None:
            raise UnsupportedModelError(
                f"{model.config.model_type!r} does not use rotary position embeddings (RoPE); KVBoost reuses KV "
                "only for RoPE decoders (Llama, Qwen2/3, Mistral, Gemma, Phi, ...)"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.name = name
        self.streaming = streaming  # layer streaming under this model (engine.weights.stream_setup), or None
        self.draft_model = draft_model  # the smaller model drafting for speculative="draft-model", or None
        self.device = next(model.parameters()).device
        # bfloat16 int4/int8 kernels on the CPU: attention in float64, so a position's KV does not depend on how
        # its prompt was cut into forwards (engine.exact_attention); part of the fingerprint.
        use_exact_attention(model)
        # Every layer in GGUF blocks under ROWS: the layers' forward in one C call (the same numbers, less overhead).
        use_block_forward(model)
        # cos and sin of the positions looked up in a table, not computed every forward (engine.rotary_table)
        use_rotary_table(model)
        self.fingerprint = fingerprint or model_fingerprint(model)
        # Chunking settings are part of every key: chunks cut differently never match.
        self._root = root_key(f"{self.fingerprint}|{config.reuse.chunking}")
        self.store, self.disk_error = build_store(config.tiers, config.reuse, self.device, self._root, name, model)
        self._breaks = TokenBreaks(tokenizer)
        self._eos_ids = self._find_eos_ids()
        self._spellings = Spellings(tokenizer)  # prompt-lookup drafts' keys, made as tokens are first seen
        self.max_context = int(getattr(model.config, "max_position_embeddings", None) or 2048)
        self._batch_repair = False
        self._rope = self._check_approx_support() if config.reuse.mode == "approx" else None
        self._reuse = KVReuse(self.store, self._root, config.reuse.chunking, self._breaks, config.reuse.repair,
                              self._rope)
        if config.decode.live_kv_bytes is not None:
            reason = spill_unsupported(model)
            if reason is not None:
                raise UnsupportedModelError(f"live_kv_bytes (spilling the live KV to host RAM): {reason}")
        self._weights_report: WeightsReport | None = None
        # One-token decode steps replayed from a CUDA graph where they can be (engine.graph_decode)
        self.graphs_unavailable = graph_decode_unavailable(model, enabled=config.decode.cuda_graphs,
                                                           streaming=streaming is not None,
                                                           spilling=config.decode.live_kv_bytes is not None)
        # The model run one request (or one batched step) at a time (engine.runner)
        self.runner = ModelRunner(model, self.device,
                                  GraphDecode(model) if self.graphs_unavailable is None else None)

    def _check_approx_support(self):
        """RoPE parameters for re-rotation; ValueError when this model's keys cannot be moved exactly or the
        chosen repair cannot run on it."""
        try:
            rope = rope_params(self.model)
        except ValueError as exc:
            raise UnsupportedModelError(f"reuse='approx' needs exact RoPE re-rotation: {exc}") from None
        why = blend_unavailable(self.model)
        # Selective repair runs batched where the blend pass can run, one forward per seam elsewhere.
        self._batch_repair = why is None
        if self.config.reuse.repair.mode == "cacheblend" and why is not None:
            raise UnsupportedModelError(
                f"repair='cacheblend' runs on {sorted(BLEND_MODEL_TYPES)} without a sliding window, not on "
                f"{why}; use repair='selective' or 'none'"
            )
        return rope

    # -- construction ----------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, source=None, *, load: LoadOptions | None = None, config: EngineConfig | None = None,
                        quiet: bool = False, cancel: threading.Event | None = None, progress=None,
                        repair_options: dict | None = None, awq_streaming: bool | None = None,
                        **options) -> "KVBoost":
        """The engine over `source` (a model folder, a .gguf file, a hub id in the local cache; None: the
        embedded model), loaded as `load` says (engine.config.LoadOptions: device, dtype, weights, kernels, layer
        streaming, a draft model) and run as `config` says (engine.config.EngineConfig: `reuse` with chunking
        and repair, the KV `tiers` with the shared one, `decode` with speculation). Every option may also be
        given by its flat name as a keyword (`weights="int4"`, `chunk_size=64`, `repair="none"`:
        engine.config.options() lists them, with their defaults, allowed values, help and older names such as
        `gpu_cache_bytes`); keywords apply over `load` and `config`. Sugar kept for callers of earlier versions:
        `repair_options` (a dict of RepairConfig fields) and `awq_streaming` (layer_streaming's old name, with a
        DeprecationWarning). A draft model turns speculative="prompt-lookup" into "draft-model".

        `quiet`: only errors from transformers' logging (no warnings or progress bars), for front ends.
        `cancel`: checked between the stages of the load; once set, the load stops there with engine.Cancelled.
        `progress(done, total, what)`: the load's steps as they happen, from the loading thread
        (engine.weights.loader.load_model: per decoder layer for GGUF and AWQ models; `total` 0 for a step of unknown
        length). info().weights says what was loaded."""
        if awq_streaming is not None:
            warnings.warn("from_pretrained(awq_streaming=...) is now layer_streaming=... (it streams any int4 or "
                          "GGUF-block layers, not only AWQ ones)", DeprecationWarning, stacklevel=2)
            if options.get("layer_streaming") and not awq_streaming:
                raise ValueError("layer_streaming=True and awq_streaming=False disagree; pass layer_streaming only")
            options["layer_streaming"] = bool(options.get("layer_streaming") or awq_streaming)
        for name, value in (repair_options or {}).items():
            options.setdefault(name, value)
        opts, config = split_options(options, load, config)
        if opts.draft_model is not None and config.decode.speculative == "prompt-lookup":  # the draft model drafts
            config = dataclasses.replace(config, decode=dataclasses.replace(config.decode, speculative="draft-model"))
        if quiet:
            loader.quiet_transformers()
        src = loader.resolve_source(source)
        _check_cancel(cancel)
        dev = loader.pick_device(opts.device)
        dt = loader.pick_dtype(opts.dtype, dev)
        if opts.layer_streaming:
            # Checked before loading the weights, from the config and headers alone, so a wrong choice fails in
            # seconds; "auto" is checked as what it will load (a 4-bit GGUF: int4).
            resolved = loader.resolve_weights(src, dev, dt, opts.weights)[0]
            reason = layer_streaming_unavailable(loader.read_config(src), dev, resolved)
            if reason is not None:
                raise UnsupportedModelError(f"layer streaming: {reason}")
        _check_cancel(cancel)
        load_weights = load_for_streaming if opts.layer_streaming and dev.type == "cuda" else loader.load_model
        # A GGUF's converted tokenizer is cached in the engine's cache folder (disk_cache_dir when given).
        model, tokenizer = load_weights(src, dev, dt, weights=opts.weights, group_size=opts.group_size,
                                        kernel=opts.kernel, head=opts.head, cache_dir=config.tiers.disk_cache_dir,
                                        progress=_load_steps(progress, cancel))
        _check_cancel(cancel)  # before fingerprinting the weights and opening the disk tier
        if rotary_module(model) is None:
            raise UnsupportedModelError(
                f"{src.describe()} is a {model.config.model_type!r} model without rotary position embeddings "
                "(RoPE); KVBoost reuses KV only for RoPE decoders (Llama, Qwen2/3, Mistral, Gemma, Phi, ...)"
            )
        streaming = None
        if opts.layer_streaming:
            _check_cancel(cancel)
            streaming = start_streaming(model, dev, budget_bytes=opts.weight_budget_bytes,
                                        num_slots=opts.stream_slots,
                                        max_context=int(getattr(model.config, "max_position_embeddings", 0) or 2048),
                                        context_bytes=config.tiers.cache_bytes or 0 if dev.type == "cuda" else 0)
        draft = None
        if opts.draft_model is not None and config.decode.speculative == "draft-model":
            _check_cancel(cancel)
            draft, draft_tokenizer = loader.load_model(loader.resolve_source(opts.draft_model), dev, dt,
                                                       cache_dir=config.tiers.disk_cache_dir)
            why = draft_model_mismatch(tokenizer, draft_tokenizer, model.get_input_embeddings().num_embeddings,
                                       draft.get_input_embeddings().num_embeddings)
            if why is not None:
                raise UnsupportedModelError(f"draft model {opts.draft_model}: {why}")
        return cls(model, tokenizer, config, name=src.describe(), streaming=streaming, draft_model=draft)

    def with_config(self, config: EngineConfig) -> "KVBoost":
        """Another engine over the same loaded model run as `config`, with its own empty memory tiers; with the
        same disk folder it sees the disk entries."""
        config.validate()
        return KVBoost(self.model, self.tokenizer, config, fingerprint=self.fingerprint, name=self.name,
                       streaming=self.streaming, draft_model=self.draft_model)

    def with_options(self, **changes) -> "KVBoost":
        """with_config over this engine's config with `changes` by their flat names (engine.config.options(),
        e.g. reuse="off", chunk_size=64, repair="none"); the model stays as loaded, so a load option is a
        ValueError."""
        table = config_options()
        loading = sorted(n for n in changes if n in table and table[n].owner is LoadOptions)
        if loading:
            raise ValueError(f"{loading} are load options: the model stays as it was loaded (load it again)")
        return self.with_config(split_options(changes, config=self.config)[1])

    def _find_eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.model.config):
            eos = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(eos, int):
                ids.add(eos)
            elif eos:
                ids.update(int(e) for e in eos)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # -- prompts ---------------------------------------------------------------------------------------
    def encode(self, prompt: str | Messages | Sequence[int], *, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a plain prompt, of a messages list rendered by the model's chat template, or of
        token ids given as they are (engine.prompt)."""
        return encode(self.tokenizer, prompt, vocab_size=self.model.get_input_embeddings().num_embeddings,
                      name=self.name, add_generation_prompt=add_generation_prompt)

    def _plan(self, ids: list[int], reuse: str):
        """The plan of `ids` in reuse mode `reuse`, without fetching anything (what tests inspect)."""
        return self._reuse.plan(ids, reuse)

    # -- generation ------------------------------------------------------------------------------------
    def stream(self, prompt: str | Messages, *, cancel: threading.Event | None = None, return_logits: bool = False,
               progress: bool = False, **sampling) -> Iterator[TokenEvent | PromptProgress | Result]:
        """Token deltas as TokenEvent, then the Result as the last event. `cancel` (optional) stops the
        generation at the next token with finish_reason "cancelled"; `return_logits` keeps the next-token
        logits at the end of the prompt in Result.first_logits; `progress`: a prompt computed in more than one
        piece (DecodeConfig.prefill_piece_tokens) also gives a PromptProgress after each piece but the last,
        before the first TokenEvent (a front end's "reading the prompt" while a big model reads a long one)."""
        t_enter = time.perf_counter()
        params = SamplingConfig.from_kwargs(**sampling)
        ids = self.encode(prompt)
        if len(ids) >= self.max_context:
            raise ValueError(f"prompt is {len(ids)} tokens; {self.name} holds at most {self.max_context} "
                             "(prompt and answer together)")
        return RequestStream(self, self._events(ids, params, t_enter, cancel, return_logits, progress))

    def _events(self, ids, params, t_enter, cancel, return_logits=False, progress=False):
        """The request as a coroutine (engine.batching): its events, and a Forward for each prefill piece and each
        decode step, whose logits the runner sends back. Run by RequestStream (alone, holding
        the engine's lock) or by a batching.Batch (which holds it for its requests)."""
        settle_thread_math()
        mode = self.config.reuse.mode
        repair = self.config.reuse.repair if mode == "approx" else None
        # 1) plan and fetch: every entry the plan reuses is acquired, on the device, until released below.
        plan, reused_by_tier = self._reuse.plan_and_fetch(ids, mode)
        try:
            approximate = repair is not None and plan.first_approximate < len(ids)
            stats = Stats(prompt_tokens=len(ids), reused_tokens=plan.reused_tokens,
                          recomputed_tokens=len(ids) - plan.reused_tokens, chunks=plan.chunk_rows(), reuse=mode,
                          repair=repair.mode if approximate else "none", reused_by_tier=reused_by_tier)
            passes_before = self.streaming.counters() if self.streaming is not None else None
            # 2) prefill: the prompt's cache from the plan (reused KV, computed runs, the blend pass).
            decode = self.config.decode
            cache = make_cache(self.model, decode.live_kv_bytes, page_tokens=decode.live_page_tokens)
            timing: list[tuple[int, float]] = []
            logits, stats.repaired_tokens = yield from prefill_steps(
                self.model, plan, self.store, cache, self.device, self._rope, repair, self._batch_repair,
                decode.prefill_piece_tokens, timing, progress)
            stats.prefill_ms = 1000 * sum(seconds for _, seconds in timing)
            # 3) decode. The new chunks are stored once the first token is out (time to first token does
            # not wait for them), the tail in `finally`: however the loop ends, the store stays consistent.
            tokens = list(ids)  # the prompt, then every sampled token
            decoder = Decoder(self.model, self.tokenizer, self.device, frozenset(self._eos_ids), self.max_context,
                              decode.speculative, decode.num_draft, self.draft_model, self._spellings)
            events = decode_tokens(decoder, cache, logits, tokens, params, stats, t_enter=t_enter, cancel=cancel,
                                   return_logits=return_logits)
            storing, chunks_stored = mode != "off", False
            try:
                sent = None
                while True:
                    event = events.send(sent)
                    sent = None
                    if isinstance(event, Forward):
                        sent = yield event  # the logits of the forward, from whoever runs this coroutine
                        continue
                    if isinstance(event, Result):
                        break
                    yield event
                    if storing and not chunks_stored:
                        chunks_stored = True
                        self._store(stats, plan, cache)
            finally:
                events.close()
                if storing:
                    self._store(stats, plan, cache, tokens, chunks=not chunks_stored)
            assert isinstance(event, Result), "the decode loop ends with its Result"
            if passes_before is not None:
                passes, tokens = (now - before for now, before in zip(self.streaming.counters(), passes_before))
                stats.weight_passes = passes
                stats.tokens_per_weight_pass = tokens / passes if passes else 0.0
            stats.total_ms = (time.perf_counter() - t_enter) * 1000  # storing the tail is part of the call
            yield event
        finally:
            self._reuse.release(plan)

    def _store(self, stats: Stats, plan, cache, tokens: list[int] | None = None, *, chunks: bool = True) -> None:
        """Stores the prompt's new chunks and, given the prompt and answer `tokens`, the tail; timed into
        stats.store_ms."""
        t0 = time.perf_counter()
        if chunks:
            self._reuse.store_chunks(plan, cache)
        if tokens is not None:
            self._reuse.store_tail(plan, cache, tokens)
        stats.store_ms += (time.perf_counter() - t0) * 1000

    def batching_unavailable(self) -> str | None:
        """Why this engine's requests cannot share forward passes with others (engine.batching), or None."""
        if self.config.decode.live_kv_bytes is not None:
            return "the live KV spills to host memory (live_kv_bytes), one request at a time"
        return batching_unavailable(self.model)

    def generate(self, prompt: str | Messages, **kwargs) -> Result:
        result = None
        for event in self.stream(prompt, **kwargs):
            result = event
        assert isinstance(result, Result)
        return result

    def chat(self, messages: Messages, **kwargs) -> Result:
        if isinstance(messages, str):
            raise ValueError("chat() takes a list of {'role', 'content'} messages; use generate() for a string")
        return self.generate(messages, **kwargs)

    def warm(self, text: str | Messages | Sequence[int]) -> dict:
        """Prefills `text` (a plain string, token ids, or messages rendered without a generation prompt) and
        stores its chunk KV, so later prompts that start with it (any reuse mode) or contain it (approx) reuse
        it. Returns what was done; with reuse="off" nothing is computed or kept."""
        t_enter = time.perf_counter()
        ids = self.encode(text, add_generation_prompt=False)
        if len(ids) >= self.max_context:
            raise ValueError(f"text is {len(ids)} tokens; {self.name} holds at most {self.max_context}")
        if self.config.reuse.mode == "off":  # nothing would be kept
            return {"tokens": len(ids), "reused_tokens": 0, "computed_tokens": 0, "entries_stored": 0,
                    "ms": (time.perf_counter() - t_enter) * 1000, "prefill_ms": 0.0}
        before = self.store.counters.stored
        params = SamplingConfig(max_new_tokens=1)
        result = None
        for event in RequestStream(self, self._events(ids, params, t_enter, None)):
            result = event
        return {
            "tokens": len(ids),
            "reused_tokens": result.stats.reused_tokens,
            "computed_tokens": result.stats.recomputed_tokens,
            "entries_stored": self.store.counters.stored - before,
            "ms": (time.perf_counter() - t_enter) * 1000,
            "prefill_ms": result.stats.prefill_ms,  # the computed tokens' forward passes alone
        }

    def info(self) -> EngineInfo:
        """What a front end shows about the loaded model: name, type, context, device, dtype, reuse mode, the
        disk cache folder (None when off) and why it is off, why layer streaming could not run, and the
        weights (`format`, `kernel`, `resident_bytes`, ...: engine.weights.weights_report)."""
        return EngineInfo(
            name=self.name,
            model_type=self.model.config.model_type,
            max_context=self.max_context,
            device=str(self.device),
            dtype=str(next(self.model.parameters()).dtype).replace("torch.", ""),
            reuse=self.config.reuse.mode,
            cache_folder=self.store.disk.folder.as_posix() if self.store.disk is not None else None,
            disk_error=self.disk_error,
            weights=self._weights(),
            cuda_graphs_unavailable=self.graphs_unavailable,
            layer_streaming_unavailable=layer_streaming_unavailable(self.model.config, self.device,
                                                                    "int4" if self._quantized() else "float"),
        )

    def _quantized(self) -> bool:
        """Whether the decoder's linears are int4 layers or a GGUF's blocks (what layer streaming can stream)."""
        report = self._weights()
        return bool(report.num_int4_linears) or report.kernel == "gguf_blocks"

    def _weights(self) -> WeightsReport:
        """weights_report of the model, made once (the weights never change under an engine)."""
        if self._weights_report is None:
            report = weights_report(self.model)
            if self.streaming is not None:  # streamed layers' images are off the device: count what is on it
                report = dataclasses.replace(report, resident_bytes=self.streaming.streamer.resident_bytes(),
                                             streaming=self.streaming.report())
            self._weights_report = report
        return self._weights_report

    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids (the cache map shows each segment's text)."""
        return self.tokenizer.decode(list(ids))

    def memory(self) -> MemoryReport:
        """Bytes held by the weights and by cached KV per tier ("device", "host", "disk"), the remote tier's
        counters (`remote`: hits, bytes read and written, dropped writes, errors, breaker state) when there is
        one, and the device's totals when it is CUDA. Reads counters only (no lock, no network), so a UI can call
        it while a request runs."""
        used = total = None
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
        remote = self.store.remote
        return MemoryReport(
            device=str(self.device), weights_bytes=self._weights().resident_bytes,
            streamed_weights_bytes=self.streaming.plan.streamed_bytes if self.streaming is not None else 0,
            kv_bytes=self.store.tier_bytes(), kv_budget_bytes=self.store.tier_budgets(),
            kv_quant=self.store.tier_quants(), kv_entries=self.store.tier_entries(),
            kv_budget_rules=self.store.tier_budget_rules(), disk_error=self.disk_error or None,
            remote=RemoteTierStats(**remote.stats()) if remote is not None else None,
            device_used_bytes=used, device_total_bytes=total)

    def cache_stats(self) -> CacheStats:
        """The store's statistics (engine.kv.store.ChunkStore.stats: each tier in `tiers`, the remote one too),
        with this engine's reuse mode, chunking and why its disk tier is off (if it is)."""
        stats = self.store.stats()
        stats["tiers"] = TierStats.from_store(stats["tiers"])
        chunking = self.config.reuse.chunking
        return CacheStats(**stats, reuse=self.config.reuse.mode, disk_error=self.disk_error or None,
                          chunking=ChunkingStats(mode=chunking.mode, size=chunking.size))

    def clear_cache(self) -> None:
        self.store.clear()

    @torch.inference_mode()
    def full_prefill_logits(self, ids: list[int]) -> torch.Tensor:
        """Next-token logits [V] of a plain full prefill, no cache involved (the reference for tests/bench)."""
        out = self.model(input_ids=torch.tensor([ids], device=self.device), use_cache=False, logits_to_keep=1)
        return out.logits[0, -1]

