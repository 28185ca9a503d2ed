"""The OpenAI wire format: request models (pydantic), response and stream-chunk builders, and error objects.

Requests accept the fields of OpenAI's completions and chat completions that the server honours, the ones it
can accept only at their neutral value (`n` 1, no `logprobs`, no tools, zero penalties) and Crest's own:
`crest_store` (which store drafts for this request), `drafter` (a drafter name), `learn` (whether the finished
request teaches its store, default true) and OpenAI's predicted outputs, `prediction: {"type": "content",
"content": ...}`. OpenAI's own `store` (a boolean: whether OpenAI keeps the completion) is accepted and
ignored; a string `store` is the old spelling of `crest_store`, still read. Anything else is refused with a 400
rather than ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from crest.errors import ConfigError


class StreamOptions(BaseModel):
    """`stream_options`: whether the last chunk carries the usage."""

    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class Prediction(BaseModel):
    """OpenAI's predicted output: text expected to appear in the answer, drafted from."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["content"] = "content"
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        """Return the predicted text (content parts joined)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(str(part.get("text", "")) for part in self.content)


class _Common(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    store: bool | str | None = None  # OpenAI's boolean (ignored: nothing is kept); a string: crest_store's old name
    # crest's own
    crest_store: str | None = None
    drafter: str | None = None
    learn: bool = True  # the finished request teaches its store (when the server learns)
    prediction: Prediction | None = None

    def stops(self) -> list[str]:
        """Return the stop strings as a list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def store_name(self) -> str | None:
        """Return the crest store this request drafts from: `crest_store`, else a string `store`."""
        if self.crest_store is not None:
            return self.crest_store
        return self.store if isinstance(self.store, str) else None

    def check(self) -> None:
        """Raise ConfigError for options the server cannot honour."""
        if self.n != 1:
            raise ConfigError("n > 1 is not supported: send one request per completion")
        if self.logprobs not in (None, False, 0):
            raise ConfigError("logprobs are not supported")
        if self.presence_penalty or self.frequency_penalty or self.logit_bias:
            raise ConfigError("presence_penalty, frequency_penalty and logit_bias are not supported")
        if len(self.stops()) > 4 or any(not isinstance(s, str) or not s for s in self.stops()):
            raise ConfigError("stop must be up to 4 non-empty strings")
        if isinstance(self.store, str) and self.crest_store is not None and self.store != self.crest_store:
            raise ConfigError(f"crest_store {self.crest_store!r} and store {self.store!r} differ: give one")


class CompletionRequest(_Common):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        """Raise ConfigError for options the server cannot honour."""
        super().check()
        if self.echo or (self.best_of or 1) != 1 or self.suffix:
            raise ConfigError("echo, best_of and suffix are not supported")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) and len(self.prompt) != 1:
            raise ConfigError("one prompt per request: batches of prompts are not supported")


class ChatMessage(BaseModel):
    """One chat message (text content, or text parts)."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """Return the message's text; raise ConfigError for non-text parts."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.get("type") != "text" for part in self.content):
            raise ConfigError("only text content parts are supported")
        return "".join(str(part.get("text", "")) for part in self.content)


class ChatRequest(_Common):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None

    def check(self) -> None:
        """Raise ConfigError for options the server cannot honour."""
        super().check()
        if self.tools or self.functions or self.tool_choice not in (None, "none"):
            raise ConfigError("tools and function calling are not supported")
        if self.top_logprobs:
            raise ConfigError("logprobs are not supported")
        if self.response_format not in (None, {"type": "text"}):
            raise ConfigError("response_format other than text is not supported")


def error_body(
    message: str, *, kind: str = "invalid_request_error", param: str | None = None, code: Any = None
) -> dict[str, Any]:
    """Return an OpenAI-style error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def model_card(name: str) -> dict[str, Any]:
    """Return the served model as an entry of GET /v1/models."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "crest"}


def new_id(prefix: str) -> str:
    """Return a fresh response id."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(
    prompt_tokens: int,
    completion_tokens: int,
    accepted: int,
    rejected: int,
    *,
    predicted: bool = False,
    forward_passes: int | None = None,
) -> dict[str, Any]:
    """Return the usage object: the prediction's tokens kept and dropped, and crest's draft and forward counts.

    OpenAI counts `accepted_prediction_tokens` / `rejected_prediction_tokens` only for a request with a
    `prediction` (0 otherwise); crest's drafts of every source are counted in its own `crest` object.
    """
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens_details": {
            "accepted_prediction_tokens": accepted if predicted else 0,
            "rejected_prediction_tokens": rejected if predicted else 0,
        },
        "crest": {"accepted_draft_tokens": accepted, "rejected_draft_tokens": rejected},
    }
    if forward_passes is not None:  # M = completion_tokens / forward_passes
        body["crest"]["forward_passes"] = forward_passes
    return body


def finish_reason(stop_reason: str | None) -> str:
    """Return OpenAI's finish reason for a generation's stop reason."""
    return "length" if stop_reason in ("length", "context") else "stop"


def completion_body(
    *, chat: bool, rid: str, model: str, text: str, reason: str | None, usage_: dict[str, Any] | None
) -> dict[str, Any]:
    """Return a whole (non-streamed) completion or chat completion."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }
    if usage_ is not None:
        body["usage"] = usage_
    return body


def chunk_body(
    *, chat: bool, rid: str, model: str, text: str | None, reason: str | None, first: bool = False
) -> dict[str, Any]:
    """Return one stream chunk: a text piece, or the last chunk with the finish reason."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    return {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }
