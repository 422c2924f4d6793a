"""Answers from a remote OpenAI-compatible server (vLLM, SGLang, llama.cpp's server, another machine's
kvboost-server) through the `openai` client, and its API key in the OS keyring (the `keyring` package), never in
the SQLite file. Qt-free: EngineClient runs `chat` on a thread of its own and turns its callbacks into the same
signals a local answer sends.

An answer is the engine client's answer dict: text, finish_reason ("stop", "length", "cancelled", or
"interrupted" when the connection broke after some text came), stats (remote=True, the model, TTFT and decode
rate measured here, usage, and the server's `kvboost` statistics when it is ours), no segments. A failure before
any text raises RemoteError with what the server said.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

KEYRING_SERVICE = "kvboost-desktop remote server"


class RemoteError(ValueError):
    """The remote server refused, failed or could not be reached; the message says which (shown as is)."""


# -- the API key, in the OS keyring ------------------------------------------------------------------------------
def store_api_key(base_url: str, api_key: str | None) -> None:
    """Keeps `api_key` for `base_url` in the OS keyring (None or "": forgets it). RemoteError when there is no
    usable keyring (the key then lives only as long as the app)."""
    import keyring
    from keyring.errors import KeyringError, PasswordDeleteError

    try:
        if api_key:
            keyring.set_password(KEYRING_SERVICE, base_url, api_key)
        else:
            try:
                keyring.delete_password(KEYRING_SERVICE, base_url)
            except PasswordDeleteError:
                pass
    except KeyringError as exc:
        raise RemoteError(f"the API key could not be kept in the OS keyring ({exc}); it is used until the app "
                          "quits") from exc


def load_api_key(base_url: str) -> str | None:
    import keyring
    from keyring.errors import KeyringError

    try:
        return keyring.get_password(KEYRING_SERVICE, base_url)
    except KeyringError:
        return None


# -- the server --------------------------------------------------------------------------------------------------
def _message(exc: Exception, base_url: str) -> str:
    import openai

    if isinstance(exc, openai.AuthenticationError):
        return f"{base_url} refused the API key (HTTP 401): check the key in Model ▸ Remote server…"
    if isinstance(exc, openai.APIStatusError):
        detail = getattr(exc, "message", "") or str(exc)
        return f"{base_url} answered HTTP {exc.status_code}: {detail}"
    if isinstance(exc, openai.APIConnectionError):
        return f"cannot reach {base_url}: {exc.__cause__ or exc}"
    return f"{base_url}: {type(exc).__name__}: {exc}"


class RemoteProvider:
    def __init__(self, base_url: str, api_key: str | None = None, *, timeout_s: float = 120.0):
        import openai

        self.base_url = base_url.rstrip("/")
        # A server without keys still wants the header from the client: any placeholder does.
        self._client = openai.OpenAI(base_url=self.base_url, api_key=api_key or "none", max_retries=0,
                                     timeout=timeout_s)

    def models(self) -> list[str]:
        """The model ids GET /v1/models lists."""
        try:
            return [m.id for m in self._client.models.list()]
        except Exception as exc:
            raise RemoteError(_message(exc, self.base_url)) from exc

    def chat(self, messages: list[dict], sampling: dict, *, model: str, on_text: Callable[[str], None],
             cancel: threading.Event) -> dict:
        """Streams one answer; `on_text(delta)` per piece of text; stops when `cancel` is set."""
        kwargs = {"temperature": sampling.get("temperature"), "top_p": sampling.get("top_p"),
                  "max_tokens": sampling.get("max_new_tokens"), "seed": sampling.get("seed"),
                  "stop": sampling.get("stop")}
        t0 = time.perf_counter()
        first = None
        parts: list[str] = []
        finish, usage, kvboost, error = None, None, None, None
        try:
            stream = self._client.chat.completions.create(
                model=model, messages=messages, stream=True, stream_options={"include_usage": True},
                **{k: v for k, v in kwargs.items() if v is not None})
        except Exception as exc:
            raise RemoteError(_message(exc, self.base_url)) from exc
        try:
            for chunk in stream:
                if cancel.is_set():
                    finish = "cancelled"
                    break
                extra = chunk.model_extra or {}
                kvboost = extra.get("kvboost") or kvboost
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    if choice.delta and choice.delta.content:
                        first = first or time.perf_counter()
                        parts.append(choice.delta.content)
                        on_text(choice.delta.content)
                    finish = choice.finish_reason or finish
        except Exception as exc:  # the connection broke, or the server sent an error event mid-stream
            if not parts:
                raise RemoteError(_message(exc, self.base_url)) from exc
            finish, error = "interrupted", f"the answer from {self.base_url} broke off: {_message(exc, self.base_url)}"
        finally:
            try:
                stream.close()  # a cancel closes the connection: the server stops generating
            except Exception:  # a connection already broken has nothing left to close
                pass
        end = time.perf_counter()
        completion = usage.completion_tokens if usage else len(parts)
        stats = {"remote": True, "model": model, "base_url": self.base_url,
                 "prompt_tokens": usage.prompt_tokens if usage else None, "completion_tokens": completion,
                 "ttft_ms": ((first or end) - t0) * 1000,
                 "decode_tokens_per_s": (completion - 1) / (end - first) if first and end > first and completion > 1
                 else None,
                 "reused_tokens": (kvboost or {}).get("reused_tokens", 0), "kvboost": kvboost,
                 "reuse": (kvboost or {}).get("reuse", "remote")}
        if finish is None:
            finish, error = "interrupted", f"the answer from {self.base_url} ended without a finish reason"
        return {"text": "".join(parts), "finish_reason": finish, "stats": stats, "segments": [], "saved_ms": None,
                "error": error}
