"""The facade users import: KVBoost.from_pretrained, generate, chat, stream, warm, cache_stats."""

from __future__ import annotations

import dataclasses
import logging
import sqlite3
import threading
import time
from typing import Iterator, Sequence

import torch

from . import loader
from .approx import BLEND_MODEL_TYPES, apply_selective, fill_approximate, merge_misses
from .assemble import EXACT, PREFIX, QUANTIZED, cache_kv, plan_prompt, store_new_chunks
from .chunking import TokenBreaks, chunk_spans
from .config import ChunkingConfig, EngineConfig, KVQuantConfig, RepairConfig, SamplingConfig
from .disk import DiskTier, default_cache_dir
from .payload_file import FORMAT_VERSION
from .eviction import POLICIES
from .generate import Result, TokenEvent, generate_events
from .keys import chain_key, root_key
from .paged import spill_unsupported
from .rope import rope_params
from .store import ChunkStore
from .tiers import MemoryTier, default_device_budget, default_host_budget

log = logging.getLogger(__name__)

Messages = Sequence[dict]

# Below this share of the prompt, reuse costs more than it saves (see KVBoost._plan).
MIN_REUSE_FRACTION = 0.25


class UnsupportedModelError(ValueError):
    """A model this engine cannot serve correctly (no RoPE, ...)."""


def rope_module(model):
    """The rotary embedding module of a decoder, or None for models without RoPE (gpt2, ALiBi models)."""
    for name, module in model.named_modules():
        if name.endswith("rotary_emb"):
            return module
    return None


def awq_streaming_unavailable(model_config, device: torch.device) -> str | None:
    """Why AWQ layer streaming cannot run for this model on this device, or None when it could."""
    if device.type != "cuda":
        return "needs a CUDA GPU (this engine runs on the CPU)"
    quant = getattr(model_config, "quantization_config", None) or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    if str(method).lower() != "awq":
        return "needs an AWQ int4 checkpoint (this model is not AWQ-quantized)"
    return None


def _serves_its_tokens(seg, ids: list[int]) -> bool:
    """Whether the entry a segment reuses holds the very tokens of the prompt there (it always should; this is
    the last check before reuse, against entries whose bookkeeping was changed behind the store's back)."""
    record = seg.record
    return tuple(ids[seg.start:seg.end]) == record.tokens[seg.offset:seg.offset + seg.num_tokens]


class KVBoost:
    def __init__(self, model, tokenizer, config: EngineConfig | None = None, *, fingerprint: str | None = None,
                 name: str = "model"):
        config = config or EngineConfig()
        config.validate()
        if rope_module(model) is None:
            raise UnsupportedModelError(
                f"{model.config.model_type!r} does not use rotary position embeddings (RoPE); KVBoost reuses KV "
                "only for RoPE decoders (Llama, Qwen2/3, Mistral, Gemma, Phi, ...)"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.name = name
        self.device = next(model.parameters()).device
        self.fingerprint = fingerprint or loader.fingerprint(model)
        # Chunking settings are part of every key: chunks cut differently never match.
        self._root = root_key(f"{self.fingerprint}|{config.chunking}")
        self.disk_error: str | None = None
        self.store = self._make_store()
        self._breaks = TokenBreaks(tokenizer)
        self._eos_ids = self._find_eos_ids()
        self.max_context = self._find_max_context()
        self._batch_repair = False
        self._rope = self._check_approx_support() if config.reuse == "approx" else None
        if config.live_kv_bytes is not None:
            reason = spill_unsupported(model)
            if reason is not None:
                raise UnsupportedModelError(f"live_kv_bytes (spilling the live KV to host RAM): {reason}")
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._weights_bytes: int | None = None

    def _make_store(self) -> ChunkStore:
        config = self.config
        policy = POLICIES[config.eviction]()
        budget = config.cache_bytes if config.cache_bytes is not None else default_device_budget(self.device)
        host = None
        host_budget = config.cpu_cache_bytes if config.cpu_cache_bytes is not None else \
            default_host_budget(self.device)
        if host_budget > 0:
            host = MemoryTier("host", host_budget, torch.device("cpu"), config.kv_quant.host,
                              pin=self.device.type == "cuda")
        disk = None
        if config.disk_cache_bytes != 0 and config.reuse != "off":
            folder = config.disk_cache_dir or str(default_cache_dir())
            # Entries are shared only within one namespace: same weights, dtype, chunking and storage format.
            namespace = chain_key(self._root, [FORMAT_VERSION]).hex() + f"-{config.kv_quant.disk}"
            try:
                disk = DiskTier(folder, config.disk_cache_bytes, config.kv_quant.disk, namespace, policy,
                                model_name=self.name, timeout_s=config.disk_busy_timeout_s)
                disk.describe_namespace({"chunking": self.config.chunking.mode,
                                         "chunk_size": self.config.chunking.size,
                                         "kv_quant": config.kv_quant.disk, "dtype": str(self.model.dtype)})
            except (ValueError, OSError, sqlite3.Error) as exc:
                # The engine still works from memory; the reason is in memory() and cache_stats().
                self.disk_error = f"disk KV tier off: {exc}"
                log.warning(self.disk_error)
                disk = None
        return ChunkStore(budget, policy, device=self.device, device_quant=config.kv_quant.device, host=host,
                          disk=disk)

    def _check_approx_support(self):
        """RoPE parameters for re-rotation; ValueError when this model's keys cannot be moved exactly or the
        chosen repair cannot run on it."""
        try:
            rope = rope_params(self.model)
        except ValueError as exc:
            raise UnsupportedModelError(f"reuse='approx' needs exact RoPE re-rotation: {exc}") from None
        config = self.model.config
        model_type = config.model_type
        windowed = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
        # Selective repair runs batched where the blend pass can run, one forward per seam elsewhere.
        self._batch_repair = model_type in BLEND_MODEL_TYPES and not windowed
        if self.config.repair.mode == "cacheblend" and not self._batch_repair:
            why = "a sliding attention window" if windowed else f"model type {model_type!r}"
            raise UnsupportedModelError(
                f"repair='cacheblend' runs on {sorted(BLEND_MODEL_TYPES)} without a sliding window, not on "
                f"{why}; use repair='selective' or 'none'"
            )
        return rope

    # -- construction ----------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, source=None, *, device="auto", dtype="auto", reuse="chunk", chunk_size=128,
                        chunking="fixed", repair="selective", cache_bytes=None, gpu_cache_bytes=None,
                        cpu_cache_bytes=None, disk_cache_bytes=None, disk_cache_dir=None, kv_quant=None,
                        eviction="importance-lru", live_kv_bytes=None, live_page_tokens=128,
                        repair_options: dict | None = None, awq_streaming: bool = False,
                        quiet: bool = False) -> "KVBoost":
        """`repair_options`: selective_tokens, blend_ratio, probe_layer (see RepairConfig).
        KV tiers: `gpu_cache_bytes` (the device tier; `cache_bytes` is the same), `cpu_cache_bytes` (host RAM),
        `disk_cache_bytes` / `disk_cache_dir` (persistent, shared by processes); None sizes a tier from the
        machine, 0 turns host or disk off. `kv_quant`: "none" | "int8" | "int4" for host and disk, or a dict
        per tier. `eviction`: "lru" | "importance-lru". `live_kv_bytes`: device bytes for the KV of the request
        being generated, beyond which cold pages of `live_page_tokens` spill to host RAM (attention stays exact).
        `awq_streaming`: stream AWQ int4 layers from host memory (CUDA + AWQ models only; see
        awq_streaming_unavailable). `quiet`: only errors from transformers' logging (no warnings or progress
        bars), for front ends."""
        if quiet:
            loader.quiet_transformers()
        if cache_bytes is not None and gpu_cache_bytes is not None and cache_bytes != gpu_cache_bytes:
            raise ValueError("cache_bytes and gpu_cache_bytes are the same budget; pass one of them")
        config = EngineConfig(reuse=reuse, chunking=ChunkingConfig(mode=chunking, size=chunk_size),
                              repair=RepairConfig(mode=repair, **(repair_options or {})),
                              cache_bytes=gpu_cache_bytes if gpu_cache_bytes is not None else cache_bytes,
                              cpu_cache_bytes=cpu_cache_bytes, disk_cache_bytes=disk_cache_bytes,
                              disk_cache_dir=str(disk_cache_dir) if disk_cache_dir is not None else None,
                              kv_quant=KVQuantConfig.parse(kv_quant), eviction=eviction,
                              live_kv_bytes=live_kv_bytes, live_page_tokens=live_page_tokens)
        config.validate()
        src = loader.resolve_source(source)
        dev = loader.pick_device(device)
        dt = loader.pick_dtype(dtype, dev)
        if awq_streaming:
            # Checked before loading the weights, from the config alone, so a wrong choice fails in seconds.
            reason = awq_streaming_unavailable(loader.read_config(src), dev)
            raise UnsupportedModelError(
                f"AWQ layer streaming: {reason}" if reason else
                "AWQ layer streaming is not available in this version of the engine; load without it"
            )
        model, tokenizer = loader.load_model(src, dev, dt)
        if rope_module(model) is None:
            raise UnsupportedModelError(
                f"{src.describe()} is a {model.config.model_type!r} model without rotary position embeddings "
                "(RoPE); KVBoost reuses KV only for RoPE decoders (Llama, Qwen2/3, Mistral, Gemma, Phi, ...)"
            )
        return cls(model, tokenizer, config, name=src.describe())

    def with_options(self, **changes) -> "KVBoost":
        """Another engine over the same loaded model, with its own empty memory tiers (e.g. reuse="off"); with
        the same disk folder it sees the disk entries. Takes every from_pretrained option but the model's own
        (source, device, dtype, awq_streaming), and the RepairConfig fields."""
        chunking = self.config.chunking
        if "chunk_size" in changes or "chunking" in changes:
            chunking = ChunkingConfig(mode=changes.pop("chunking", chunking.mode),
                                      size=changes.pop("chunk_size", chunking.size))
        repair = self.config.repair
        repair_fields = {k: changes.pop(k) for k in ("selective_tokens", "selective_before", "blend_ratio", "probe_layer", "blend_seam_tokens")
                         if k in changes}
        if "repair" in changes:
            repair = RepairConfig(mode=changes.pop("repair"))
        repair = dataclasses.replace(repair, **repair_fields)
        if "gpu_cache_bytes" in changes:
            changes["cache_bytes"] = changes.pop("gpu_cache_bytes")
        if "kv_quant" in changes:
            changes["kv_quant"] = KVQuantConfig.parse(changes["kv_quant"])
        if changes.get("disk_cache_dir") is not None:
            changes["disk_cache_dir"] = str(changes["disk_cache_dir"])
        inherited = ("reuse", "cache_bytes", "cpu_cache_bytes", "disk_cache_bytes", "disk_cache_dir",
                     "disk_busy_timeout_s", "kv_quant", "eviction", "live_kv_bytes", "live_page_tokens")
        fields = {name: getattr(self.config, name) for name in inherited}
        fields["repair"] = repair
        fields.update(changes)
        return KVBoost(self.model, self.tokenizer, EngineConfig(chunking=chunking, **fields),
                       fingerprint=self.fingerprint, name=self.name)

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

    def _find_max_context(self) -> int:
        limit = getattr(self.model.config, "max_position_embeddings", None) or 2048
        return int(limit)

    # -- prompts ---------------------------------------------------------------------------------------
    def encode(self, prompt: str | Messages | Sequence[int], *, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a plain prompt, of a messages list rendered by the model's chat template, or of
        token ids given as they are."""
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) for t in prompt):
            vocab = self.model.get_input_embeddings().num_embeddings
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"token ids out of range [0, {vocab}): {bad[:5]}")
            return list(prompt)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return list(self.tokenizer(prompt)["input_ids"])
        messages = list(prompt)
        if not messages:
            raise ValueError("messages list is empty")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
            if not isinstance(m["content"], str):
                raise ValueError(f"message {i} content must be a string, got {type(m['content']).__name__}")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(f"{self.name} has no chat template; pass a plain string prompt")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _plan(self, ids: list[int], reuse: str):
        spans, num_complete = chunk_spans(ids, self.config.chunking, self._breaks)
        plan = self._plan_reuse(ids, spans, num_complete, reuse)
        if 0 < plan.reused_tokens < MIN_REUSE_FRACTION * len(ids):
            # Attention over a cached past runs with an explicit mask, which on CPU costs about twice the
            # causal fast path (measured: 68 vs 36 ms per layer, 1945 queries over 1980 keys): reusing a small
            # part of a long prompt is slower than not reusing it.
            plan = plan_prompt(ids, spans, num_complete, self._root, self.store, "off")
        return plan

    def _plan_reuse(self, ids, spans, num_complete, reuse):
        if reuse != "approx":
            return plan_prompt(ids, spans, num_complete, self._root, self.store, reuse)
        repair = self.config.repair

        def approximate(segments):
            segments = fill_approximate(merge_misses(segments), ids, self.store, self._rope)
            if repair.mode == "selective":
                segments = apply_selective(segments, repair.selective_tokens, repair.selective_before)
            elif repair.mode == "cacheblend" and repair.blend_seam_tokens:
                # Seam tokens become computed tokens, which the blend pass always recomputes.
                segments = apply_selective(segments, repair.blend_seam_tokens)
            return segments

        return plan_prompt(ids, spans, num_complete, self._root, self.store, "chunk", refine=approximate)

    # -- generation ------------------------------------------------------------------------------------
    def stream(self, prompt: str | Messages, *, cancel: threading.Event | None = None, return_logits: bool = False,
               **sampling) -> Iterator[TokenEvent | Result]:
        """Token deltas as TokenEvent, then the Result as the last event. `cancel` (optional) stops the
        generation at the next token with finish_reason "cancelled"; `return_logits` keeps the next-token
        logits at the end of the prompt in Result.first_logits."""
        t_enter = time.perf_counter()
        params = SamplingConfig.from_kwargs(**sampling)
        ids = self.encode(prompt)
        if len(ids) >= self.max_context:
            raise ValueError(f"prompt is {len(ids)} tokens; {self.name} holds at most {self.max_context} "
                             "(prompt and answer together)")
        return self._events(ids, params, t_enter, cancel, return_logits)

    def _events(self, ids, params, t_enter, cancel, return_logits=False):
        # Requests on one engine run one at a time; a second stream opened and iterated on the thread that
        # holds the first would wait for itself forever, so that is an error.
        if self._owner == threading.get_ident():
            raise RuntimeError("a stream is still open on this engine in this thread; finish or close it first")
        self._lock.acquire()
        self._owner = threading.get_ident()
        try:
            reuse = self.config.reuse
            plan, reused_by_tier = self._plan_and_fetch(ids, reuse)
            storing = reuse != "off"
            try:
                yield from generate_events(
                    self.model, self.tokenizer, plan, self.store, params, device=self.device,
                    eos_ids=self._eos_ids, max_context=self.max_context, t_enter=t_enter, reuse=reuse,
                    cancel=cancel, rope=self._rope, repair=self.config.repair if reuse == "approx" else None,
                    batch_repair=self._batch_repair,
                    return_logits=return_logits, reused_by_tier=reused_by_tier,
                    live_kv=(self.config.live_kv_bytes, self.config.live_page_tokens),
                    on_prefilled=(lambda cache: store_new_chunks(plan, cache, self.store, self._root.hex()))
                    if storing else None,
                    on_finished=(lambda cache, all_ids: self._store_tail(plan, cache, all_ids))
                    if storing else None,
                )
            finally:
                self._release(plan)
        finally:
            self._owner = None
            self._lock.release()

    def _plan_and_fetch(self, ids: list[int], reuse: str):
        """The plan, with every entry it reuses acquired and its payload on the device. An entry whose disk
        payload turns out missing, corrupt or not the KV of the tokens it would serve is dropped and the prompt
        planned again without it (its text becomes a MISS and is computed and stored afresh). Hits served
        lossy values are relabelled QUANTIZED. Returns the plan and reused tokens per tier served from."""
        if reuse != "off":
            self.store.sync_disk()  # entries other processes wrote since the last request
        served_from: dict[bytes, tuple[str, bool]] = {}  # where each entry was before any fetch moved it
        while True:
            plan = self._plan(ids, reuse)
            records = list({id(s.record): s.record for s in plan.segments if s.record is not None}.values())
            for record in records:
                served_from.setdefault(record.key, (record.tier, self.store.served_lossy(record)))
            for seg in plan.segments:
                if seg.record is not None:
                    self.store.acquire(seg.record)
            try:
                bad = [r for r in records if not self.store.fetch(r)]
            except BaseException:  # e.g. out of device memory while promoting: nothing stays acquired
                self._release(plan)
                raise
            bad += [seg.record for seg in plan.segments if seg.record is not None
                    and all(r is not seg.record for r in bad) and not _serves_its_tokens(seg, ids)]
            if not bad:
                break
            self._release(plan)
            for record in bad:
                served_from.pop(record.key, None)
                self.store.drop(record)
        self.store.counters.misses += sum(1 for s in plan.segments if s.kind == "MISS")
        reused_by_tier: dict[str, int] = {}
        for seg in plan.segments:
            if seg.record is None:
                continue
            tier, lossy = served_from[seg.record.key]
            if lossy and seg.kind in (EXACT, PREFIX):
                seg.kind = QUANTIZED
            self.store.touch(seg.record, seg.kind, tier)
            reused_by_tier[tier] = reused_by_tier.get(tier, 0) + seg.num_tokens
        self.store.touch_disk(records)
        return plan, reused_by_tier

    def _release(self, plan) -> None:
        for seg in plan.segments:
            if seg.record is not None:
                self.store.release(seg.record)

    def _store_tail(self, plan, cache, all_ids: list[int]) -> None:
        """The KV after the last complete chunk (partial chunk + answer), for the next turn's token-level
        reuse. The last sampled token was never fed to the model, so the KV ends one before it. Not stored
        when the prompt had APPROXIMATE hits: tails serve exact continuations only."""
        end = cache.get_seq_length()
        start = plan.tail_start
        if end <= start or plan.first_approximate < len(plan.ids):
            return
        tokens = all_ids[start:end]
        key = chain_key(plan.tail_parent + b"tail", tokens)
        self.store.put_tail(key, plan.tail_parent, start, tokens, cache_kv(cache, start, end),
                            lossy=plan.first_lossy < end)

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
        if self.config.reuse == "off":  # nothing would be kept
            return {"tokens": len(ids), "reused_tokens": 0, "computed_tokens": 0, "entries_stored": 0,
                    "ms": (time.perf_counter() - t_enter) * 1000}
        before = self.store.counters.stored
        params = SamplingConfig(max_new_tokens=1)
        result = None
        for event in self._events(ids, params, t_enter, None):
            result = event
        return {
            "tokens": len(ids),
            "reused_tokens": result.stats.reused_tokens,
            "computed_tokens": result.stats.recomputed_tokens,
            "entries_stored": self.store.counters.stored - before,
            "ms": (time.perf_counter() - t_enter) * 1000,
        }

    def info(self) -> dict:
        """What a front end shows about the loaded model: name, type, context, device, dtype, reuse mode, the
        disk cache folder (None when off) and why it is off, and why AWQ layer streaming could not run."""
        return {
            "name": self.name,
            "model_type": self.model.config.model_type,
            "max_context": self.max_context,
            "device": str(self.device),
            "dtype": str(next(self.model.parameters()).dtype).replace("torch.", ""),
            "reuse": self.config.reuse,
            "cache_folder": self.store.disk.folder.as_posix() if self.store.disk is not None else None,
            "disk_error": self.disk_error,
            "awq_unavailable": awq_streaming_unavailable(self.model.config, self.device),
        }

    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids (the cache map shows each segment's text)."""
        return self.tokenizer.decode(list(ids))

    def memory(self) -> dict:
        """Bytes held by the weights and by cached KV per tier ("device", "host", "disk"), and the device's
        totals when it is CUDA. Reads counters only (no lock), so a UI can call it while a request runs."""
        if self._weights_bytes is None:  # counted once: the UI asks every second
            self._weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        weights = self._weights_bytes
        report = {"device": str(self.device), "weights_bytes": weights, "kv_bytes": self.store.tier_bytes(),
                  "kv_budget_bytes": self.store.tier_budgets()}
        if self.disk_error:
            report["disk_error"] = self.disk_error
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            report["device_used_bytes"] = total - free
            report["device_total_bytes"] = total
        return report

    def cache_stats(self) -> dict:
        stats = self.store.stats()
        stats["reuse"] = self.config.reuse
        if self.disk_error:
            stats["disk_error"] = self.disk_error
        stats["chunking"] = {"mode": self.config.chunking.mode, "size": self.config.chunking.size}
        return stats

    def clear_cache(self) -> None:
        self.store.clear()

    @torch.inference_mode()
    def full_prefill_logits(self, ids: list[int]) -> torch.Tensor:
        """Next-token logits [V] of a plain full prefill, no cache involved (the reference for tests/bench)."""
        out = self.model(input_ids=torch.tensor([ids], device=self.device), use_cache=False, logits_to_keep=1)
        return out.logits[0, -1]
