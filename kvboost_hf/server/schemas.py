"""Request and response bodies of the OpenAI-compatible API (the subset the server honours).

Fields the server does not implement but clients commonly send (``presence_penalty``, ``tools``, ...) are
ignored; fields it implements are validated here, so a bad value is a 400 naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS = 20


class TextPart(BaseModel):
    """One part of a multi-part message content (text only)."""

    type: Literal["text"] = "text"
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """Settings shared by both endpoints. ``max_tokens`` None = up to ``default_max_tokens`` of the server."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    cache_salt: str | None = Field(
        default=None,
        max_length=256,
        description="Extension: requests with different salts never share cached chunks (tenant isolation).",
    )

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise ValueError(f"stop must be up to {MAX_STOP_STRINGS} non-empty strings")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] = Field(description="One prompt (lists of exactly one string are accepted).")
    max_tokens: int | None = Field(default=None, ge=1, description="default 16, as in the OpenAI API")
    logprobs: int | None = Field(default=None, ge=0, le=5)


class WarmRequest(BaseModel):
    """Text to pre-load: a string, or chat messages (rendered without a generation prompt)."""

    model_config = ConfigDict(extra="forbid")

    text: str | None = None
    messages: list[ChatMessage] | None = None
    cache_salt: str | None = Field(default=None, max_length=256)


class WarmResponse(BaseModel):
    chunks_stored: int
    token_count: int
    chunk_size: int
    partial_tail_tokens: int
    alignment_warning: str | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvboost_hf"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class ChatChoice(BaseModel):
    index: int
    message: dict[str, Any]
    logprobs: dict[str, Any] | None = None
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
