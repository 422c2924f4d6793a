"""The OpenAI API's request bodies as pydantic models, and its error JSON, for engine.server."""

from __future__ import annotations

import json
from typing import Literal, Union

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError


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
class RequestBody(BaseModel):
    # Fields OpenAI clients send that change nothing here (user, metadata, ...) are accepted and ignored.
    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stream: bool = False
    stop: Union[str, list[str], None] = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # what torch's generator takes
    stream_options: dict | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart], None] = None


class ChatBody(RequestBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionBody(RequestBody):
    prompt: Union[str, list[str], list[int]]
    max_tokens: int = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = None


async def parse(request: Request, model: type[BaseModel]):
    """The body as `model`, whatever the Content-Type says (curl -d sends form encoding), or an APIError
    naming the first problem and the field it is in."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"malformed JSON in the request body: {type(exc).__name__}: {exc}"[:300],
                       code="invalid_json") from None
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
