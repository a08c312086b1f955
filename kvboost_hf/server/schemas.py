"""Request and response bodies of the OpenAI-compatible API.

Requests are validated strictly: types are not coerced (``max_tokens: "10"`` or ``true`` and ``stream: "yes"``
are 400s), and a request field the server does not implement is a 400 naming it, never accepted and ignored. An
explicit ``null`` for a known field means its default (as the OpenAI API reads it; SDKs send ``null`` for options
set to None). Inside messages unknown keys are ignored: clients send back the assistant messages they received
with their own additions (litellm's ``provider_specific_fields``), and the message ``name`` has no place in a
chat template. The extensions ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``stop_token_ids``,
``ignore_eos`` (as in vLLM), ``cache_salt`` and ``document_boundaries`` (chat; which message contents are documents
for non-prefix reuse, see :mod:`kvboost_hf.hf.chat_segments`) are accepted in the body (``extra_body`` in the
openai SDK).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvboost_hf.core.errors import InputError

MAX_STOP_STRINGS = 4
DocumentBoundaryName = Literal["none", "parts", "messages"]
MAX_TOP_LOGPROBS = 20
FUNCTION_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


class _Strict(BaseModel):
    """No type coercion, unknown keys refused; an explicit ``null`` for a known field means the field's default."""

    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        known = {field.alias or name for name, field in cls.model_fields.items()}
        return {key: value for key, value in data.items() if value is not None or key not in known}


class _Message(_Strict):
    """A part of a chat message: unknown keys are ignored (clients echo messages back with their own fields)."""

    model_config = ConfigDict(extra="ignore")


class ContentPart(BaseModel):
    """One part of a multi-part message content; only ``text`` parts are supported."""

    model_config = ConfigDict(strict=True, extra="allow")

    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type in ("image_url", "input_image", "image"):
            raise InputError("images are unsupported: this server's model reads text only")
        if self.type != "text":
            raise InputError(f"content parts of type {self.type!r} are unsupported (text only)")
        if self.text is None:
            raise InputError("a text part needs 'text'")
        return self


class FunctionCall(_Message):
    name: str
    arguments: str = Field(description="JSON text of the arguments object")


class ToolCallIn(_Message):
    """A tool call of an earlier assistant turn, as the API returned it."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Message):
    """One chat message; ``name`` is accepted and not rendered (chat templates have no place for it)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _roles(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise InputError("only assistant messages carry tool_calls")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise InputError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text or "" for part in self.content)
        return self.content or ""

    def parts(self) -> str | list[str]:
        """The content as the engine takes it: a string, or the texts of its parts (a list content)."""
        if isinstance(self.content, list):
            return [part.text or "" for part in self.content]
        return self.content or ""


class FunctionDefinition(_Strict):
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaSpec(_Strict):
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise InputError("json_schema is required with type 'json_schema' and only then")
        return self


class StreamOptions(_Strict):
    include_usage: bool = False


class _GenerationRequest(_Strict):
    """Settings shared by both endpoints. ``max_tokens`` None = up to ``default_max_tokens`` of the server."""

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
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(default=None, description="token id -> bias in [-100, 100]")
    top_k: int = Field(default=0, ge=-1, description="Extension: keep the k most likely tokens (0 or -1: off).")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, description="Extension: drop tokens below min_p * top prob.")
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0, description="Extension: as in transformers.")
    min_tokens: int = Field(default=0, ge=0, description="Extension: end tokens are banned until this many exist.")
    stop_token_ids: list[int] | None = Field(default=None, description="Extension: token ids that end a choice.")
    ignore_eos: bool = Field(default=False, description="Extension: EOS does not end a choice.")
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
            raise InputError(f"stop must be up to {MAX_STOP_STRINGS} non-empty strings")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            if not (token.isascii() and token.isdigit()):  # "²".isdigit() is True, int("²") fails
                raise InputError(f"logit_bias keys are token ids, got {token!r}")
            if not -100.0 <= bias <= 100.0:
                raise InputError(f"logit_bias values must be in [-100, 100], got {bias} for token {token}")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class ChatCompletionRequest(_GenerationRequest):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}]}]
        }
    )

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    document_boundaries: DocumentBoundaryName | None = Field(
        default=None,
        description="Extension: which contents start documents for non-prefix reuse (--reuse-mode chunk_kv_reuse): "
        "'parts' (each text part of a message with several), 'messages' (also each message), 'none'; default: the "
        "server's.",
    )


class CompletionRequest(_GenerationRequest):
    model_config = ConfigDict(json_schema_extra={"examples": [{"model": "SmolLM2-135M-Instruct", "prompt": "Hi"}]})

    prompt: str | list[str] = Field(description="One prompt (lists of exactly one string are accepted).")
    max_tokens: int | None = Field(default=None, ge=1, description="default 16, as in the OpenAI API")
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = Field(default=False, description="only false is supported")
    suffix: str | None = Field(default=None, description="unsupported: must be absent or empty")
    best_of: int | None = Field(default=None, ge=1, description="only equal to n (no server-side selection)")


class WarmRequest(_Strict):
    """What to pre-load (exactly one): a string, chat messages (rendered without a generation prompt), or
    documents (each stored alone, as a content part or message holding it is tokenized, by content key)."""

    text: str | None = None
    messages: list[ChatMessage] | None = None
    documents: list[str] | None = Field(default=None, min_length=1)
    cache_salt: str | None = Field(default=None, max_length=256)


class WarmResponse(BaseModel):
    chunks_stored: int
    token_count: int
    chunk_size: int
    partial_tail_tokens: int
    alignment_warning: str | None = None


class TokenizeRequest(_Strict):
    """``prompt`` (tokenised as /v1/completions does) or ``messages`` (rendered as /v1/chat/completions does)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int | None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


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


def plain_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Text-only messages as the engine renders them ("developer" is a system message; a list content is the list
    of its parts' texts, which the engine joins)."""
    return [{"role": engine_role(m.role), "content": m.parts()} for m in messages]


def engine_role(role: str) -> str:
    """A message's role as the chat template gets it: "developer" is a system message."""
    return "system" if role == "developer" else role
