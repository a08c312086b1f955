"""Request and response bodies of the Responses API subset served at ``POST /v1/responses``: text, streaming,
structured output and function tools (field names as in the ``openai`` SDK's ``openai.types.responses``).

Validation is as strict as the chat endpoint's (:mod:`kvboost_hf.server.schemas`): wrong types and fields this
server does not implement are 400s naming them. Items of an earlier response passed back as input
(``input=[..., *response.output]``) are accepted as the server sent them: their ``id`` and ``status``, and the
``annotations`` and ``logprobs`` of ``output_text`` parts, are read and ignored (they carry no instruction).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from kvboost_hf.core.errors import InputError
from kvboost_hf.server.schemas import FUNCTION_NAME_PATTERN, DocumentBoundaryName, _Strict

MAX_METADATA_PAIRS = 16  # OpenAI's limits on ``metadata``
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class TextPart(BaseModel):
    """One part of an item's content: ``input_text`` or ``output_text`` (text only)."""

    model_config = ConfigDict(strict=True, extra="allow")  # checked below, after the part's type is known

    type: str
    text: str | None = None
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None

    @model_validator(mode="after")
    def _text_only(self) -> TextPart:
        if self.type in ("input_image", "input_file", "input_audio"):
            raise InputError(f"{self.type} parts are unsupported: this server's model reads text only")
        if self.type not in ("input_text", "output_text"):
            raise InputError(f"content parts of type {self.type!r} are unsupported (input_text, output_text)")
        if self.model_extra:
            raise InputError(f"unsupported field(s) {sorted(self.model_extra)} in a {self.type} part")
        if self.text is None:
            raise InputError(f"an {self.type} part needs 'text'")
        return self


def text_of(content: str | list[TextPart]) -> str:
    """The text of an item's content (parts joined without separator)."""
    return content if isinstance(content, str) else "".join(part.text or "" for part in content)


class MessageItem(_Strict):
    """A conversation message (``type`` may be left out, as in the SDK's ``EasyInputMessage``)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallItem(_Strict):
    """A function call of an earlier assistant turn, as a response returned it."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = Field(description="JSON text of the arguments object")
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(_Strict):
    """The result of the call ``call_id``, sent back by the client."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]
    id: str | None = None
    status: ItemStatus | None = None


def _item_type(value: Any) -> str | None:
    """The union tag of an input item: its ``type``, "message" when a dict has none."""
    if isinstance(value, dict):
        kind = value.get("type", "message")
        return kind if isinstance(kind, str) else None
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(
        _item_type,
        custom_error_type="invalid_item",
        custom_error_message="input items are 'message', 'function_call' or 'function_call_output' items",
    ),
]
# ``input``: a string (one user message) or items. Tagged, so a bad item is reported alone (not beside "input should
# be a string"); the tags are the type names the error handler leaves out of ``param``.
Input = Annotated[
    Annotated[str, Tag("str")] | Annotated[list[InputItem], Field(min_length=1), Tag("list[InputItem]")],
    Discriminator(lambda value: "str" if isinstance(value, str) else "list[InputItem]"),
]


class FunctionTool(_Strict):
    """A function the model may call (the Responses API's flat form: no nested ``function`` object)."""

    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    """``text.format``: free text, any JSON object, or JSON valid against ``schema``."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise InputError("type 'json_schema' needs 'name' and 'schema'")
        if self.type != "json_schema" and (self.name, self.schema_, self.strict) != (None, None, None):
            raise InputError(f"'name', 'schema' and 'strict' belong to type 'json_schema', not {self.type!r}")
        return self


class TextConfig(_Strict):
    format: TextFormat | None = None


class ResponsesRequest(_Strict):
    """``POST /v1/responses``. ``max_output_tokens`` None = up to ``default_max_tokens`` of the server."""

    model_config = ConfigDict(
        json_schema_extra={"examples": [{"model": "SmolLM2-135M-Instruct", "input": "Hi", "max_output_tokens": 16}]}
    )

    model: str
    input: Input
    instructions: str | None = Field(default=None, description="rendered as the first system message")
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = Field(default=None, description="echoed in the response")
    user: str | None = Field(default=None, max_length=256)
    store: bool | None = Field(default=None, description="accepted; this server stores no response")
    previous_response_id: str | None = Field(
        default=None, description="unsupported (400): nothing is stored, send the whole conversation as input"
    )
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1, description="Extension: as in chat completions.")
    cache_salt: str | None = Field(
        default=None,
        max_length=256,
        description="Extension: requests with different salts never share cached chunks (tenant isolation).",
    )
    document_boundaries: DocumentBoundaryName | None = Field(
        default=None, description="Extension: as in chat completions (input_text parts of a message are its parts)."
    )

    @field_validator("metadata")
    @classmethod
    def _check_metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        pairs = value or {}
        if len(pairs) > MAX_METADATA_PAIRS:
            raise InputError(f"metadata holds at most {MAX_METADATA_PAIRS} pairs")
        for key, text in pairs.items():
            if len(key) > MAX_METADATA_KEY_CHARS or len(text) > MAX_METADATA_VALUE_CHARS:
                raise InputError(
                    f"metadata keys are up to {MAX_METADATA_KEY_CHARS} characters and values up to "
                    f"{MAX_METADATA_VALUE_CHARS}"
                )
        return value


class InputTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens whose K/V were loaded from the store")


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """A ``response``: ``output`` holds ``message`` items (``output_text`` parts) and ``function_call`` items; the
    request's settings are echoed. ``store`` is always false (nothing is stored)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[dict[str, Any]]
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    previous_response_id: None = None
    store: Literal[False] = False
    temperature: float | None = None
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float | None = None
    user: str | None = None
