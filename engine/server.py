"""OpenAI-compatible HTTP front end over one KVBoost engine: translates HTTP to engine calls and nothing more.

    GET  /health                 {"status": "ok", ...}
    GET  /v1/models              the one served model
    POST /v1/chat/completions    chat template from the model; streaming (SSE, `data: [DONE]`) or not
    POST /v1/completions         a plain prompt

Requests run one at a time on the engine (it holds one KV cache per request) in arrival order: a FIFO queue is
fair, and a request's place in it is visible in the `kvboost.queue_ms` field. A streaming client that goes away
cancels its generation at the next token; a queued request whose client went away never runs. Every response
carries the engine's cache statistics in an extra `kvboost` field that OpenAI clients ignore.

Errors are OpenAI-style JSON `{"error": {"message", "type", "param", "code"}}` with the matching status.
Nothing in a request names a file: the model is matched by id against the one loaded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .generate import Result, TokenEvent

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 << 20
MAX_QUEUE = 64


# -- errors ---------------------------------------------------------------------------------------------------
class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code)


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status)


# -- request bodies -------------------------------------------------------------------------------------------
class _Body(BaseModel):
    # Fields OpenAI clients send that change nothing here (user, metadata, ...) are accepted and ignored.
    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stream: bool = False
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    stream_options: dict | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart], None] = None


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionBody(_Body):
    prompt: Union[str, list[str], list[int]]
    max_tokens: int = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = None


# -- the engine queue -------------------------------------------------------------------------------------------
@dataclass
class Job:
    prompt: Any  # token ids
    sampling: dict
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    cancel: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.perf_counter)
    started: float | None = None


class Scheduler:
    """Runs jobs one at a time on its own thread, in arrival order."""

    def __init__(self, engine, max_queue: int = MAX_QUEUE):
        self.engine = engine
        self.max_queue = max_queue
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._count_lock = threading.Lock()
        self.num_waiting = 0
        self.num_running = 0
        self.num_served = 0
        self._thread = threading.Thread(target=self._work, name="kvboost-server-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._count_lock:
            if self.num_waiting >= self.max_queue:
                raise APIError(429, f"the server is busy: {self.num_waiting} requests are waiting; retry later",
                               "rate_limit_error", code="queue_full")
            self.num_waiting += 1
        self._jobs.put(job)

    def close(self) -> None:
        self._jobs.put(None)

    def _emit(self, job: Job, item) -> None:
        try:
            job.loop.call_soon_threadsafe(job.events.put_nowait, item)
        except RuntimeError:  # the server's loop is closed: nobody is listening any more
            job.cancel.set()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with self._count_lock:
                self.num_waiting -= 1
            if job.cancel.is_set():  # its client went away while it waited
                continue
            self.num_running += 1
            job.started = time.perf_counter()
            try:
                for event in self.engine.stream(job.prompt, cancel=job.cancel, **job.sampling):
                    self._emit(job, event)
            except Exception as exc:  # reported to the one request; the server goes on
                log.exception("request failed")
                self._emit(job, exc)
            finally:
                self.num_running -= 1
                self.num_served += 1


# -- translation ------------------------------------------------------------------------------------------------
def _sampling(body: _Body, max_tokens: int) -> dict:
    if body.n != 1:
        raise APIError(400, "n must be 1: this server generates one choice per request", param="n")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > 4 or any(not s for s in stop):
        raise APIError(400, "stop takes up to 4 non-empty strings", param="stop")
    return {"max_new_tokens": max_tokens, "temperature": body.temperature, "top_p": body.top_p,
            "stop": stop or None, "seed": body.seed}


def _chat_messages(body: ChatBody) -> list[dict]:
    messages = []
    for i, m in enumerate(body.messages):
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
        role = "system" if m.role == "developer" else m.role
        messages.append({"role": role, "content": content})
    return messages


def kvboost_stats(result: Result, job: Job) -> dict:
    s = result.stats
    by_kind: dict[str, int] = {}
    for start, end, kind in s.chunks:
        by_kind[kind] = by_kind.get(kind, 0) + end - start
    return {"prompt_tokens": s.prompt_tokens, "reused_tokens": s.reused_tokens,
            "recomputed_tokens": s.recomputed_tokens, "tokens_by_kind": by_kind,
            "reused_by_tier": s.reused_by_tier, "ttft_ms": round(s.ttft_ms, 2),
            "queue_ms": round(((job.started or job.enqueued) - job.enqueued) * 1000, 2),
            "decode_tokens_per_s": round(s.decode_tokens_per_s, 2), "reuse": s.reuse}


def _usage(result: Result) -> dict:
    prompt, completion = result.stats.prompt_tokens, result.stats.generated_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finish_reason(result: Result) -> str:
    return "length" if result.finish_reason == "length" else "stop"


# -- the app ------------------------------------------------------------------------------------------------------
def create_app(engine, *, model_id: str, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES,
               max_queue: int = MAX_QUEUE) -> FastAPI:
    """The HTTP app over `engine`, served under `model_id`. The engine must not be used by anyone else
    without its own lock (the desktop app shares it: the engine's lock serialises the two)."""
    app = FastAPI(title="KVBoost", docs_url=None, redoc_url=None, openapi_url=None)
    scheduler = Scheduler(engine, max_queue)
    app.state.scheduler = scheduler
    created = int(time.time())

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if api_key is not None and request.url.path != "/health":
            header = request.headers.get("authorization", "")
            if header != f"Bearer {api_key}":
                return error_response(401, "missing or wrong API key (send Authorization: Bearer <key>)",
                                      "invalid_request_error", code="invalid_api_key")
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > max_body_bytes):
            return error_response(413, f"request body over {max_body_bytes} bytes", code="body_too_large")
        if request.method == "POST" and length is None:
            body = b""
            async for piece in request.stream():
                body += piece
                if len(body) > max_body_bytes:
                    return error_response(413, f"request body over {max_body_bytes} bytes", code="body_too_large")
            request._body = body  # read once: the handler parses it from here
        return await call_next(request)

    @app.exception_handler(APIError)
    async def on_api_error(_request, exc: APIError):
        return exc.response()


    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_request, exc: StarletteHTTPException):
        kind = "not_found" if exc.status_code == 404 else None
        return error_response(exc.status_code, str(exc.detail), code=kind)

    def check_model(name: str) -> None:
        if name != model_id:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_id!r}", param="model",
                           code="model_not_found")

    def encode(prompt, chat: bool) -> list[int]:
        try:
            ids = engine.encode(prompt)
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages" if chat else "prompt") from None
        if len(ids) >= engine.max_context:
            raise APIError(400, f"this model's maximum context length is {engine.max_context} tokens; the prompt "
                           f"is {len(ids)} tokens", param="messages" if chat else "prompt",
                           code="context_length_exceeded")
        return ids

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_id, "waiting": scheduler.num_waiting,
                "running": scheduler.num_running, "served": scheduler.num_served}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                            "owned_by": "kvboost"}]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        check_model(name)
        return {"id": model_id, "object": "model", "created": created, "owned_by": "kvboost"}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await parse(request, ChatBody)
        check_model(body.model)
        ids = encode(_chat_messages(body), chat=True)
        max_tokens = body.max_completion_tokens or body.max_tokens or engine.max_context - len(ids)
        job = start(ids, _sampling(body, max_tokens))
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return EventSourceResponse(stream_chat(job, rid, include_usage), ping=15)
        result = await collect(job, request)
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_id,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                             "logprobs": None, "finish_reason": _finish_reason(result)}],
                "usage": _usage(result), "kvboost": kvboost_stats(result, job)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse(request, CompletionBody)
        check_model(body.model)
        if body.echo or body.logprobs is not None:
            raise APIError(400, "echo and logprobs are not supported", param="echo" if body.echo else "logprobs")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "send one prompt per request", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str) and not prompt:
            raise APIError(400, "prompt is empty", param="prompt")
        if isinstance(prompt, list) and not prompt:
            raise APIError(400, "prompt is empty", param="prompt")
        ids = encode(prompt, chat=False)
        job = start(ids, _sampling(body, body.max_tokens))
        rid = f"cmpl-{uuid.uuid4().hex[:24]}"
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return EventSourceResponse(stream_completion(job, rid, include_usage), ping=15)
        result = await collect(job, request)
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_id,
                "choices": [{"index": 0, "text": result.text, "logprobs": None,
                             "finish_reason": _finish_reason(result)}],
                "usage": _usage(result), "kvboost": kvboost_stats(result, job)}

    def start(ids: list[int], sampling: dict) -> Job:
        try:
            from .config import SamplingConfig

            SamplingConfig.from_kwargs(**sampling)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        job = Job(ids, sampling, asyncio.get_running_loop(), asyncio.Queue())
        scheduler.submit(job)
        return job

    async def collect(job: Job, request: Request) -> Result:
        """The job's Result; cancels it when the client disconnects first."""
        while True:
            try:
                item = await asyncio.wait_for(job.events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancel.set()
                    raise APIError(499, "client closed the request") from None
                continue
            if isinstance(item, Exception):
                raise _engine_error(item)
            if isinstance(item, Result):
                return item

    async def events(job: Job):
        """TokenEvents then the Result; the job is cancelled however the consumer stops (disconnect included)."""
        try:
            while True:
                item = await job.events.get()
                if isinstance(item, Exception):
                    raise _engine_error(item)
                yield item
                if isinstance(item, Result):
                    return
        finally:
            job.cancel.set()

    def chunk(rid: str, obj: str, choice: dict, **extra) -> dict:
        return {"data": json.dumps({"id": rid, "object": obj, "created": int(time.time()), "model": model_id,
                                    "choices": [choice], **extra})}

    async def stream_chat(job: Job, rid: str, include_usage: bool):
        obj = "chat.completion.chunk"
        yield chunk(rid, obj, {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
        async for item in _safe(events(job), rid, obj):
            if isinstance(item, dict):
                yield item
            elif isinstance(item, TokenEvent):
                if item.text:
                    yield chunk(rid, obj, {"index": 0, "delta": {"content": item.text}, "finish_reason": None})
            else:
                yield chunk(rid, obj, {"index": 0, "delta": {}, "finish_reason": _finish_reason(item)},
                            kvboost=kvboost_stats(item, job))
                if include_usage:
                    yield {"data": json.dumps({"id": rid, "object": obj, "created": int(time.time()),
                                               "model": model_id, "choices": [], "usage": _usage(item)})}
        yield {"data": "[DONE]"}

    async def stream_completion(job: Job, rid: str, include_usage: bool):
        obj = "text_completion"
        async for item in _safe(events(job), rid, obj):
            if isinstance(item, dict):
                yield item
            elif isinstance(item, TokenEvent):
                if item.text:
                    yield chunk(rid, obj, {"index": 0, "text": item.text, "logprobs": None, "finish_reason": None})
            else:
                yield chunk(rid, obj, {"index": 0, "text": "", "logprobs": None,
                                       "finish_reason": _finish_reason(item)}, kvboost=kvboost_stats(item, job))
                if include_usage:
                    yield {"data": json.dumps({"id": rid, "object": obj, "created": int(time.time()),
                                               "model": model_id, "choices": [], "usage": _usage(item)})}
        yield {"data": "[DONE]"}

    async def _safe(source, rid: str, obj: str):
        """Passes items through; an engine failure mid-stream becomes one OpenAI error event (the status line
        has been sent already)."""
        try:
            async for item in source:
                yield item
        except APIError as exc:
            yield {"data": json.dumps({"error": {"message": exc.message, "type": exc.type, "param": exc.param,
                                                 "code": exc.code}})}

    return app


async def parse(request: Request, model: type[BaseModel]):
    """The body as `model`, whatever the Content-Type says (curl -d sends form encoding), or an APIError
    naming the first problem and the field it is in."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise APIError(400, f"malformed JSON in the request body: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}",
                       code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ())) or None
        raise APIError(400, f"{param}: {first.get('msg')}" if param else str(first.get("msg")), param=param,
                       code=first.get("type")) from None


def _engine_error(exc: Exception) -> APIError:
    if isinstance(exc, ValueError):
        return APIError(400, str(exc))
    return APIError(500, f"the engine failed: {type(exc).__name__}: {exc}", "server_error")


def serve(engine, *, model_id: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          log_level: str = "warning") -> None:
    """Runs the server in this thread until interrupted."""
    import uvicorn

    uvicorn.run(create_app(engine, model_id=model_id, api_key=api_key), host=host, port=port, log_level=log_level)
