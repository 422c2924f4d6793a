"""The OpenAI API's request bodies as pydantic models, and its error JSON, for server.app.

Bodies are read strictly, as OpenAI reads them: `true` is not a number, `"0.5"` is not a temperature, `2.0` is not
a token count. A body that is not valid JSON text is refused as a whole (400 `invalid_json`): NaN and Infinity
(which Python's json would read) and numbers beyond float range included. So is one with a lone UTF-16 surrogate
escape in any string (`"\\ud800"`, 400 `invalid_unicode` naming the field): it is not Unicode text, and replacing
it with U+FFFD would answer a question the client did not ask.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal, Union

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError


# -- errors ---------------------------------------------------------------------------------------------------
class APIError(Exception):
    """An OpenAI-style error; `headers` go on its response (`connection: close` for a body left half read)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code, self.headers)


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status, headers=headers)


# -- request bodies -------------------------------------------------------------------------------------------
# Fields OpenAI clients send that change nothing here (user, metadata, ...) are accepted and ignored.
STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class RequestBody(BaseModel):
    model_config = STRICT

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # any value in range samples (tiny ones greedily)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stream: bool = False
    stop: Union[str, list[str], None] = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # what torch's generator takes
    stream_options: StreamOptions | None = None


class TextPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart], None] = None


class ChatBody(RequestBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None  # each answer token's log-probability ...
    top_logprobs: int | None = Field(None, ge=0, le=20)  # ... with this many likeliest tokens (needs logprobs)


class CompletionBody(RequestBody):
    prompt: Union[str, list[str], list[int]]
    max_tokens: int = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)  # the legacy API's: each token's, and this many likeliest


async def parse(request: Request, model: type[BaseModel]):
    """The body as `model`, whatever the Content-Type says (curl -d sends form encoding); see `parse_body`."""
    return parse_body(await request.body(), model)


def parse_body(raw: bytes, model: type[BaseModel]):
    """`raw` as `model`, or an APIError (400) naming the first problem and the field it is in."""
    try:
        data = json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"malformed JSON in the request body: {type(exc).__name__}: {exc}"[:300],
                       code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}",
                       code="invalid_json")
    _check_unicode(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = _field_path(data, first.get("loc", ()), missing=first.get("type") == "missing") or None
        raise APIError(400, f"{param}: {first.get('msg')}" if param else str(first.get("msg")), param=param,
                       code=first.get("type")) from None


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number (JSON numbers are finite)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def _check_unicode(data: Any) -> None:
    """Refuses a string (value or key) holding a lone surrogate, naming where it is. Iterative: the nesting is as
    deep as json.loads allowed."""
    stack = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                inner = f"{path}.{key}" if path else key
                _check_text(path or None, key, "a key")
                stack.append((inner, item))
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}", item) for i, item in enumerate(value))
        elif isinstance(value, str):
            _check_text(path, value, "the text")


def _check_text(path: str | None, text: str, what: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = f"{path}: " if path else ""
        raise APIError(400, f"{where}{what} holds a lone surrogate (\\u{ord(text[exc.start]):04x} at character "
                       f"{exc.start}), which is not valid Unicode; send text as UTF-8 or as paired \\u escapes",
                       param=path, code="invalid_unicode") from None


def _field_path(data: Any, loc: tuple, missing: bool) -> str:
    """The part of a pydantic error location that names fields in `data`, without the union member names pydantic
    adds (`prompt.list[int].0` -> `prompt`); a `missing` field's own name ends it."""
    names = []
    for part in loc:
        if isinstance(data, dict) and isinstance(part, str) and part in data:
            data = data[part]
        elif isinstance(data, list) and isinstance(part, int) and 0 <= part < len(data):
            data = data[part]
        else:
            if missing and isinstance(part, str):
                names.append(part)
            break
        names.append(str(part))
    return ".".join(names)
