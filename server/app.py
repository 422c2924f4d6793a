"""OpenAI-compatible HTTP front end over one KVBoost engine: translates HTTP to engine calls and nothing more.

    GET  /health                 {"status": "ok", ...}
    GET  /v1/models              the one served model
    POST /v1/chat/completions    chat template from the model; streaming (SSE, `data: [DONE]`) or not
    POST /v1/completions         a plain prompt

Requests run on the engine's one thread (an EngineWorker: the desktop app's, where the window's requests take turns
with the API's, or the server's own), decoded together in one batch (engine.batching: up to the worker's
`max_batch` at once, a newcomer joining at the next step); past that they wait in arrival order, and a request's
wait is its `kvboost.queue_ms`.
A client that goes away cancels its generation at the next token, or before it runs. Every response carries the
engine's cache statistics in an extra `kvboost` field that OpenAI clients ignore.

Errors are OpenAI-style JSON `{"error": {"message", "type", "param", "code"}}` with the matching status.
Nothing in a request names a file: the model is matched by id against the one loaded. Prompts are tokenized on a
thread of their own (a megabyte of text takes a second), so the event loop keeps answering. Clients that are slow
to send meet `Timeouts`: the request head, the body, and the pause between requests on one connection each have
a deadline (30 s, 30 s and 5 s by default).

Over 400 lines: the routes, the engine queue behind them and the translation between OpenAI's bodies and the
engine's calls are read together; the guard and the schemas are modules of their own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import uvicorn
from fastapi import FastAPI, Request
from jinja2 import TemplateError
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine import MAX_BATCH, EngineWorker, Job, Result, SamplingConfig, TokenEvent, WorkerStopped

from .guard import Guard, Timeouts, server_options  # noqa: F401  (server_options: part of this module's API)
from .schema import APIError, ChatBody, CompletionBody, RequestBody, error_response, parse

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 << 20
MAX_QUEUE = 64


# -- the engine queue -------------------------------------------------------------------------------------------
class Scheduler:
    """The HTTP side of the engine queue: admission (429 past `max_queue` waiting, 503 once closing), counts, and
    tokenizing on a thread of its own (a long prompt takes seconds: it must neither block the event loop nor wait
    behind a generation). Requests run on `worker`, the one torch thread, as jobs of source "api" (engine.worker.Job,
    the one job type of every front end): the desktop app passes its own worker (its window's requests take turns
    with these); without one the server has its own."""

    def __init__(self, engine, max_queue: int = MAX_QUEUE, worker: EngineWorker | None = None,
                 max_batch: int = MAX_BATCH):
        self.engine = engine
        self.max_queue = max_queue
        self._owns_worker = worker is None
        self.worker = worker if worker is not None else EngineWorker(name="kvboost-server-engine",
                                                                     max_batch=max_batch)
        self._lock = threading.Lock()
        self._waiting: list[Job] = []
        self._running: list[Job] = []
        self._closed = False
        self.num_served = 0  # jobs that ran (to the end, or cancelled part way)
        self.num_cancelled = 0  # of those, stopped by a cancel (client gone, server closing)
        self.num_skipped = 0  # cancelled before they ran
        # One thread: the tokenizer is one object, and its Rust side refuses some concurrent use.
        self._encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvboost-server-tokenize")

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    async def encode(self, prompt) -> list[int]:
        """`engine.encode(prompt)` off the event loop; its errors come through as they are."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._encoder, self.engine.encode, prompt)
        except RuntimeError:
            if self._closed:  # the executor was shut down under this request
                raise APIError(503, "the server is shutting down", "server_error", code="shutting_down") from None
            raise

    def submit(self, prompt: list[int], sampling: dict) -> tuple[Job, asyncio.Queue]:
        """Queues a generation of `prompt` (token ids) on the worker, from the event loop. Returns its job and the
        queue its TokenEvents, then its Result (or an exception), arrive in."""
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        ready = threading.Event()  # set once `job` below is known: the worker may take the job before that

        def run(cancel: threading.Event):
            ready.wait()
            with self._lock:
                self._waiting.remove(job)
                self._running.append(job)
            return self.engine.stream(prompt, cancel=cancel, **sampling)

        def emit(item) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, item)
            except RuntimeError:  # the server's loop is closed: nobody is listening any more
                job.cancel()

        def on_event(event) -> None:
            if isinstance(event, Result) and event.finish_reason == "cancelled":
                self.num_cancelled += 1
            emit(event)

        def on_done(done: Job) -> None:
            ready.wait()
            self._ended(done, emit)

        with self._lock:
            if self._closed:
                raise APIError(503, "the server is shutting down", "server_error", code="shutting_down")
            if len(self._waiting) >= self.max_queue:
                raise APIError(429, f"the server is busy: {len(self._waiting)} requests are waiting; retry later",
                               "rate_limit_error", code="queue_full")
            try:
                job = self.worker.submit(run, source="api", sink=on_event, on_done=on_done)
            except WorkerStopped:  # the app's worker, stopped as the app quits
                raise APIError(503, "the server is shutting down", "server_error", code="shutting_down") from None
            self._waiting.append(job)
        ready.set()
        return job, events

    def close(self) -> None:
        """Stops taking jobs and cancels its running and waiting ones (each gets an error or its partial end); a
        worker it was given goes on with its other jobs, its own worker stops."""
        with self._lock:
            self._closed = True
            jobs = self._waiting + self._running
        for job in jobs:
            job.cancel()
        self._encoder.shutdown(wait=False, cancel_futures=True)
        if self._owns_worker:
            self.worker.stop(deadline_s=0)  # cancelled, and ends by itself; never waited for here

    def _ended(self, job: Job, emit) -> None:
        with self._lock:  # one step: once nothing runs, the counts are final
            if job.state == job.SKIPPED:  # its client went away while it waited, or the server is closing
                self._waiting.remove(job)
                self.num_skipped += 1
            else:
                if job in self._running:
                    self._running.remove(job)
                self.num_served += 1
        if job.state == job.SKIPPED:
            emit(APIError(499, "the request was cancelled before it ran", code="cancelled"))
        elif job.state == job.FAILED:  # reported to the one request; the server goes on
            log.error("request failed", exc_info=job.error)
            emit(job.error)


# -- translation ------------------------------------------------------------------------------------------------
def sampling_kwargs(body: RequestBody, max_tokens: int) -> dict:
    """The engine's sampling arguments for a parsed request, or an APIError (400)."""
    if body.n != 1:
        raise APIError(400, "n must be 1: this server generates one choice per request", param="n")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > 4 or any(not s for s in stop):
        raise APIError(400, "stop takes up to 4 non-empty strings", param="stop")
    kwargs = {"max_new_tokens": max_tokens, "temperature": body.temperature, "top_p": body.top_p,
              "stop": stop or None, "seed": body.seed}
    logprobs = _logprobs_asked(body)
    if logprobs is not None:  # only then: an answer nobody asked logprobs of pays nothing for them
        kwargs["logprobs"] = logprobs
    try:
        SamplingConfig.from_kwargs(**kwargs)
    except ValueError as exc:
        raise APIError(400, str(exc)) from None
    return kwargs


def _logprobs_asked(body: RequestBody) -> int | None:
    """How many likeliest tokens each answer token's logprobs list, or None where logprobs are not asked for:
    chat's `logprobs: true` with `top_logprobs`, the legacy completions' `logprobs` (an int)."""
    if isinstance(body, ChatBody):
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        return (body.top_logprobs or 0) if body.logprobs else None
    return getattr(body, "logprobs", None)


def _token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(logprobs: list | None) -> dict | None:
    """Chat's `logprobs` of a choice or a streamed chunk, from the engine's TokenLogprobs: {"content": [{token,
    logprob, bytes, top_logprobs}]}; `bytes`: the token's text in UTF-8."""
    if logprobs is None:
        return None
    return {"content": [{"token": lp.text, "logprob": lp.logprob, "bytes": _token_bytes(lp.text),
                         "top_logprobs": [{"token": t.text, "logprob": t.logprob, "bytes": _token_bytes(t.text)}
                                          for t in lp.top]}
                        for lp in logprobs]}


def completion_logprobs(logprobs: list | None, offset: int = 0) -> dict | None:
    """The legacy completions' `logprobs`: tokens, token_logprobs, top_logprobs (token text -> logprob; two tokens
    of one text keep the likelier) and text_offset, each token's start in the completion's text from `offset`."""
    if logprobs is None:
        return None
    offsets = []
    for lp in logprobs:
        offsets.append(offset)
        offset += len(lp.text)
    tops = []
    for lp in logprobs:
        top: dict[str, float] = {}
        for t in lp.top:
            top.setdefault(t.text, t.logprob)
        tops.append(top)
    return {"tokens": [lp.text for lp in logprobs], "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": tops, "text_offset": offsets}


def _chat_messages(body: ChatBody) -> list[dict]:
    return [{"role": "system" if m.role == "developer" else m.role,
             "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])}
            for m in body.messages]


def kvboost_stats(result: Result, job: Job) -> dict:
    s = result.stats
    by_kind: dict[str, int] = {}
    for start, end, kind in s.chunks:
        by_kind[kind] = by_kind.get(kind, 0) + end - start
    return {"prompt_tokens": s.prompt_tokens, "reused_tokens": s.reused_tokens,
            "recomputed_tokens": s.recomputed_tokens, "tokens_by_kind": by_kind,
            "reused_by_tier": s.reused_by_tier, "ttft_ms": round(s.ttft_ms, 2),
            "queue_ms": round(job.queue_ms, 2),
            "decode_tokens_per_s": round(s.decode_tokens_per_s, 2), "reuse": s.reuse,
            "batched_forwards": s.batched_forwards}


def _include_usage(body: RequestBody) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


def _usage(result: Result) -> dict:
    prompt, completion = result.stats.prompt_tokens, result.stats.generated_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finish_reason(result: Result) -> str:
    return "length" if result.finish_reason == "length" else "stop"


# -- the app ------------------------------------------------------------------------------------------------------
def create_app(engine, *, model_id: str, worker: EngineWorker | None = None, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, max_queue: int = MAX_QUEUE, loopback_only: bool = True,
               timeouts: Timeouts = Timeouts(), max_batch: int = MAX_BATCH) -> FastAPI:
    """The HTTP app over `engine`, served under `model_id`. Generation runs on `worker`, the thread that runs
    everything else on this engine (the desktop app passes its own); None: a worker of the server's own.
    `loopback_only`: the server listens on 127.0.0.1, so requests naming another Host are refused (DNS
    rebinding). Of `timeouts` the app keeps the body's; `server_options` applies the others."""
    app = FastAPI(title="KVBoost", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes, loopback_only=loopback_only,
                       body_timeout=timeouts.body_s)
    scheduler = Scheduler(engine, max_queue, worker, max_batch)
    app.state.scheduler = scheduler
    card = {"id": model_id, "object": "model", "created": int(time.time()), "owned_by": "kvboost"}
    weights = engine.info().weights.to_dict()  # what was loaded: format, resident bytes, a GGUF's mix, auto's choice

    @app.exception_handler(APIError)
    async def on_api_error(_request, exc: APIError):
        return exc.response()

    @app.exception_handler(Exception)
    async def on_unexpected(_request, exc: Exception):
        log.exception("unexpected server error")
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_request, exc: StarletteHTTPException):
        kind = "not_found" if exc.status_code == 404 else None
        return error_response(exc.status_code, str(exc.detail), code=kind)

    def check_model(name: str) -> None:
        if name != model_id:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_id!r}", param="model",
                           code="model_not_found")

    async def encode(prompt, chat: bool) -> list[int]:
        try:
            ids = await scheduler.encode(prompt)
        except (ValueError, TemplateError) as exc:  # the chat template refuses (roles must alternate, ...)
            raise APIError(400, f"{type(exc).__name__ if isinstance(exc, TemplateError) else 'invalid input'}: {exc}",
                           param="messages" if chat else "prompt") from None
        if len(ids) >= engine.max_context:
            raise APIError(400, f"this model's maximum context length is {engine.max_context} tokens; the prompt "
                           f"is {len(ids)} tokens", param="messages" if chat else "prompt",
                           code="context_length_exceeded")
        return ids

    @app.get("/health")
    async def health():
        # The KV cache per tier: its budget, the bytes and chunks filling it, and where a memory tier's budget came
        # from. memory() reads counters only, so a health check never waits for a generation.
        memory = engine.memory()
        kv_cache = {tier: {"bytes": num_bytes, "budget_bytes": memory.kv_budget_bytes.get(tier, 0),
                           **({"entries": memory.kv_entries[tier]} if tier in memory.kv_entries else {}),
                           **({"budget_rule": memory.kv_budget_rules[tier]} if tier in memory.kv_budget_rules
                              else {})}
                    for tier, num_bytes in memory.kv_bytes.items()}
        return {"status": "ok", "model": model_id, "waiting": scheduler.num_waiting,
                "running": scheduler.num_running, "served": scheduler.num_served, "weights": weights,
                "kv_cache": kv_cache}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        check_model(name)
        return card

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await parse(request, ChatBody)
        check_model(body.model)
        ids = await encode(_chat_messages(body), chat=True)
        max_tokens = body.max_completion_tokens or body.max_tokens or engine.max_context - len(ids)
        job, queue = scheduler.submit(ids, sampling_kwargs(body, max_tokens))
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        if body.stream:
            return EventSourceResponse(stream_chat(job, queue, rid, _include_usage(body)), ping=15)
        result = await collect(job, queue, request)
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_id,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                             "logprobs": chat_logprobs(result.logprobs), "finish_reason": _finish_reason(result)}],
                "usage": _usage(result), "kvboost": kvboost_stats(result, job)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse(request, CompletionBody)
        check_model(body.model)
        if body.echo:
            raise APIError(400, "echo is not supported", param="echo")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "send one prompt per request", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, (str, list)) and not prompt:
            raise APIError(400, "prompt is empty", param="prompt")
        ids = await encode(prompt, chat=False)
        job, queue = scheduler.submit(ids, sampling_kwargs(body, body.max_tokens))
        rid = f"cmpl-{uuid.uuid4().hex[:24]}"
        if body.stream:
            return EventSourceResponse(stream_completion(job, queue, rid, _include_usage(body)), ping=15)
        result = await collect(job, queue, request)
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_id,
                "choices": [{"index": 0, "text": result.text, "logprobs": completion_logprobs(result.logprobs),
                             "finish_reason": _finish_reason(result)}],
                "usage": _usage(result), "kvboost": kvboost_stats(result, job)}

    async def collect(job: Job, queue: asyncio.Queue, request: Request) -> Result:
        """The job's Result; a client that disconnects first cancels it (waiting or running)."""

        async def watch():
            while not job.cancelled:
                if await request.is_disconnected():
                    job.cancel()
                    return
                await asyncio.sleep(0.25)

        watcher = asyncio.create_task(watch())
        try:
            async for item in events(job, queue):
                if isinstance(item, Result):
                    return item
        finally:
            watcher.cancel()
            job.cancel()  # a no-op once the result is in

    async def events(job: Job, queue: asyncio.Queue):
        """TokenEvents then the Result; the job is cancelled however the consumer stops (disconnect included)."""
        try:
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise _engine_error(item)
                yield item
                if isinstance(item, Result):
                    return
        finally:
            job.cancel()

    def chunk(rid: str, obj: str, choice: dict, **extra) -> dict:
        return {"data": json.dumps({"id": rid, "object": obj, "created": int(time.time()), "model": model_id,
                                    "choices": [choice], **extra})}

    async def stream(job: Job, queue: asyncio.Queue, rid: str, obj: str, include_usage: bool, text_choice, end_choice,
                     opening=None):
        """SSE events of one streamed response: `opening` (a choice, chat's role announcement), a choice per
        TokenEvent (`text_choice(event, text offset)`: its text delta, its tokens' logprobs where asked for), the
        final choice with the kvboost stats, a usage chunk if asked, then [DONE]."""
        try:
            if opening is not None:
                yield chunk(rid, obj, opening)
            try:
                offset = 0  # of the event's tokens in the answer's text (the legacy logprobs' text_offset)
                async for item in events(job, queue):
                    if isinstance(item, TokenEvent):
                        if item.text or item.logprobs:
                            yield chunk(rid, obj, text_choice(item, offset))
                        offset += sum(len(lp.text) for lp in item.logprobs or ())
                    else:
                        yield chunk(rid, obj, end_choice(_finish_reason(item)), kvboost=kvboost_stats(item, job))
                        if include_usage:
                            yield {"data": json.dumps({"id": rid, "object": obj, "created": int(time.time()),
                                                       "model": model_id, "choices": [], "usage": _usage(item)})}
            except APIError as exc:  # an engine failure mid-stream: one error event (the status line is sent)
                yield {"data": json.dumps({"error": {"message": exc.message, "type": exc.type, "param": exc.param,
                                                     "code": exc.code}})}
            yield {"data": "[DONE]"}
        finally:  # however the stream ends, a client gone included
            job.cancel()

    def stream_chat(job: Job, queue: asyncio.Queue, rid: str, include_usage: bool):
        return stream(job, queue, rid, "chat.completion.chunk", include_usage,
                      lambda event, _: {"index": 0, "delta": {"content": event.text},
                                        "logprobs": chat_logprobs(event.logprobs), "finish_reason": None},
                      lambda reason: {"index": 0, "delta": {}, "finish_reason": reason},
                      opening={"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})

    def stream_completion(job: Job, queue: asyncio.Queue, rid: str, include_usage: bool):
        return stream(job, queue, rid, "text_completion", include_usage,
                      lambda event, offset: {"index": 0, "text": event.text,
                                             "logprobs": completion_logprobs(event.logprobs, offset),
                                             "finish_reason": None},
                      lambda reason: {"index": 0, "text": "", "logprobs": None, "finish_reason": reason})

    return app


def _engine_error(exc: Exception) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        return APIError(400, str(exc))
    return APIError(500, f"the engine failed: {type(exc).__name__}: {exc}", "server_error")


def serve(engine, *, model_id: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          log_level: str = "warning", timeouts: Timeouts = Timeouts(), max_batch: int = MAX_BATCH,
          worker: EngineWorker | None = None) -> None:
    """Runs the server in this thread until interrupted, its requests on `worker` (the thread that loaded the
    engine, best: see cli.server) or an engine thread of its own, decoded up to `max_batch` at once (1: one at a
    time)."""
    app = create_app(engine, model_id=model_id, api_key=api_key, loopback_only=host in Guard.LOOPBACK_HOSTS,
                     timeouts=timeouts, max_batch=max_batch, worker=worker)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, **server_options(timeouts))
    finally:
        app.state.scheduler.close()
