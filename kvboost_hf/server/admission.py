"""From a validated request body to what the worker runs: prompt tokens and per-request settings.

Everything here that costs more than a field check (chat template rendering, tokenisation) runs in a thread
(``asyncio.to_thread``), never on the event loop. Grammars compile on the compiler's own bounded pool (its
processes started with the server: :meth:`Admission.start`), cached per ``cache_salt`` and shared out per client
address (:class:`~kvboost_hf.server.grammar.GrammarCompiler`: a client over its share of the compile queue gets a
429 naming the limit, a full queue a 503); the event loop awaits them for at most ``compile_timeout_s``, so
compiles never hold the threads that admit plain requests. A prompt whose character
count alone proves it longer than the context is refused before it is tokenised.

Tools: when the tokenizer's chat template renders ``tools`` (detected once by rendering a probe with and without
them) the tools, the assistant ``tool_calls`` and the ``tool`` messages of the history go through the template.
Otherwise this documented rendering is used: the tool list is appended to the (first) system message as
:data:`TOOL_PROMPT`, earlier calls appear in the assistant's text as ``<tool_call>{"name", "arguments"}</tool_call>``
and tool results as user messages ``<tool_response>...</tool_response>``. Either way the output is constrained to
the same tag format (:mod:`kvboost_hf.server.grammar`).

Documents: with ``reuse_mode`` chunk_kv_reuse, a chat request without tools gets segment starts where its documents
begin and end (:func:`~kvboost_hf.hf.chat_segments.encode_chat_segments`: the token ids are unchanged), chosen by its
``document_boundaries`` or the server's; the job is then prefilled alone (decoding with its batch) and its
documents hit by content key at any position. In the other modes (no non-prefix reuse) prompts get no segments.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError
from starlette.requests import Request
from transformers import LogitsProcessor

from kvboost_hf.core.config import GenerationMode
from kvboost_hf.engine import InferenceEngine
from kvboost_hf.hf.chat_segments import TEMPLATE_REFUSED, DocumentBoundaries
from kvboost_hf.hf.sampling import SamplingConfig
from kvboost_hf.server.batching import JobParams
from kvboost_hf.server.errors import ApiError
from kvboost_hf.server.grammar import (
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    Compiled,
    GrammarBusy,
    GrammarCompiler,
    GrammarError,
    GrammarQuota,
    Tool,
)
from kvboost_hf.server.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ToolDefinition,
    engine_role,
    plain_messages,
)
from kvboost_hf.server.settings import ServerConfig
from kvboost_hf.server.worker import Worker

logger = logging.getLogger(__name__)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI default of /v1/completions
TOOL_PROMPT = (
    "You can call functions. Their signatures, one JSON object per line, are inside <tools></tools>:\n"
    "<tools>\n{tools}\n</tools>\n"
    'To call a function, answer with <tool_call>{{"name": <function name>, "arguments": <arguments object>}}'
    "</tool_call>."
)
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
GRAMMAR_PARAM = "response_format.json_schema.schema"


@dataclass(frozen=True)
class Prepared:
    """A request ready to run once ``grammar`` (its constraint's compile, if any) is done. ``tool_calls``: the
    answer's text is parsed for tool calls."""

    kind: str  # "chat" or "completion"
    prompt_ids: list[int]
    params: JobParams
    n: int
    cache_salt: str | None
    stream: bool
    include_usage: bool
    tool_calls: bool
    grammar: Compiled | None = None
    segment_starts: tuple[int, ...] = ()  # token offsets where documents start and end (chat, chunk mode)


class Admission:
    """Validates and prepares requests for ``worker``; one per app."""

    def __init__(self, engine: InferenceEngine, settings: ServerConfig, worker: Worker) -> None:
        self.engine, self.settings, self.worker = engine, settings, worker
        self.vocab_size = int(engine.model.get_output_embeddings().weight.shape[0])
        tokenizer = engine.tokenizer
        longest = max(len(t) for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))) if t)
        # a prompt of more characters than this has more tokens than the context holds (a token covers at most
        # ``longest`` characters): refused before tokenisation
        self.max_prompt_chars = engine.max_context * longest if engine.max_context else None
        self._grammar: GrammarCompiler | None = None
        self._setup_lock = threading.Lock()
        self._template_renders_tools: bool | None = None
        self.document_boundaries = DocumentBoundaries(settings.document_boundaries)

    # ------------------------------------------------------------------ entry points (event loop)
    async def chat(self, body: ChatCompletionRequest, client: str | None = None) -> Prepared:
        """``client``: who the request's grammar compile is counted against (the client's address)."""
        self._check_model(body.model)
        prepared = await asyncio.to_thread(self._chat, body, client)
        if prepared.grammar is not None:
            await self._compiled(prepared.grammar, "tools" if prepared.tool_calls else GRAMMAR_PARAM)
        return prepared

    async def completion(self, body: CompletionRequest) -> Prepared:
        self._check_model(body.model)
        return await asyncio.to_thread(self._completion, body)

    async def tokenize(
        self, prompt: str | None, messages: list[ChatMessage] | None, generation_prompt: bool
    ) -> list[int]:
        if (prompt is None) == (messages is None):
            raise ApiError(400, "give exactly one of 'prompt' or 'messages'", param="prompt")
        if prompt is not None:
            return await asyncio.to_thread(self._encode, prompt, "prompt")
        encoded = await asyncio.to_thread(self._encode_chat, messages or [], None, generation_prompt)
        return encoded[0]

    async def detokenize(self, tokens: list[int]) -> str:
        self._check_token_ids(tokens, "tokens")
        return await asyncio.to_thread(self._decode, tokens)

    def check_model(self, model: str | None) -> None:
        if model is not None:
            self._check_model(model)

    # ------------------------------------------------------------------ preparation (worker threads)
    def _chat(self, body: ChatCompletionRequest, client: str | None) -> Prepared:
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        tools, required, parallel = self._tool_mode(body)
        tools = tools if body.tool_choice != "none" else []  # "none": no tools offered, none parsed
        if tools and body.logprobs:
            raise ApiError(400, "logprobs cannot be combined with tools", param="logprobs")
        fmt = body.response_format
        if tools and fmt is not None and fmt.type != "text":
            raise ApiError(400, "response_format cannot be combined with tools", param="response_format")
        prompt_ids, segment_starts = self._encode_chat(body.messages, tools, True, self._boundaries(body))
        grammar: Compiled | None = None
        who = {"tenant": body.cache_salt, "client": client}
        try:
            if tools:
                grammar = self._compiler().tool_calls(tools, required=required, parallel=parallel, **who)
            elif fmt is not None and fmt.type == "json_object":
                grammar = self._compiler().json_object(**who)
            elif fmt is not None and fmt.json_schema is not None:
                if fmt.json_schema.schema_ is None:
                    raise ApiError(400, "json_schema needs a 'schema'", param=GRAMMAR_PARAM)
                grammar = self._compiler().json_schema(fmt.json_schema.schema_, **who)
        except GrammarError as exc:
            raise ApiError(400, str(exc), param="tools" if tools else GRAMMAR_PARAM, code="invalid_schema") from exc
        except GrammarQuota as exc:
            raise ApiError(429, str(exc), code="grammar_quota", headers={"Retry-After": "1"}) from exc
        except GrammarBusy as exc:
            raise ApiError(503, str(exc), code="grammar_busy", headers={"Retry-After": "1"}) from exc
        top = (body.top_logprobs or 0) if body.logprobs else None
        budget = body.max_completion_tokens or body.max_tokens
        params = self._params(body, prompt_ids, budget, top, grammar, tool_calls=bool(tools))
        return Prepared(
            "chat",
            prompt_ids,
            params,
            body.n,
            body.cache_salt,
            body.stream,
            bool(body.stream_options and body.stream_options.include_usage),
            bool(tools),
            grammar,
            tuple(segment_starts),
        )

    def _boundaries(self, body: ChatCompletionRequest) -> DocumentBoundaries:
        """Which contents of ``body`` start documents: none unless the worker reuses non-prefix hits."""
        if self.worker.mode is not GenerationMode.CHUNK_KV_REUSE:
            return DocumentBoundaries.NONE
        if body.document_boundaries is not None:
            return DocumentBoundaries(body.document_boundaries)
        return self.document_boundaries

    async def _compiled(self, grammar: Compiled, param: str) -> None:
        """Wait (on the event loop) for ``grammar`` to compile: 400 when it cannot, 503 past the timeout (the
        compile goes on in the background and is cached for this tenant). The compile processes' start (once per
        server, seconds) is waited for first and not counted."""
        compiler = self._compiler()
        await asyncio.to_thread(compiler.wait_started)
        timeout = compiler.limits.compile_timeout_s
        compiled = asyncio.wrap_future(grammar)
        compiled.add_done_callback(_retrieve)  # a compile that fails after this wait timed out is not logged
        try:
            await asyncio.wait_for(asyncio.shield(compiled), timeout)
        except GrammarError as exc:
            raise ApiError(400, str(exc), param=param, code="invalid_schema") from exc
        except TimeoutError as exc:
            message = f"the constraint did not compile within {timeout:g} s"
            raise ApiError(503, message, param=param, code="grammar_timeout") from exc

    def _completion(self, body: CompletionRequest) -> Prepared:
        if body.echo:
            raise ApiError(400, "echo is unsupported", param="echo")
        if body.suffix:
            raise ApiError(400, "suffix is unsupported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise ApiError(400, "best_of is unsupported unless it equals n (no server-side selection)", param="best_of")
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if len(prompts) != 1:
            raise ApiError(
                400, "exactly one prompt per request is supported (use n for several choices)", param="prompt"
            )
        prompt_ids = self._encode(prompts[0], "prompt")
        limit = self.settings.max_tokens_limit or 2**31
        max_tokens = body.max_tokens or min(COMPLETIONS_DEFAULT_MAX_TOKENS, limit)
        params = self._params(body, prompt_ids, max_tokens, body.logprobs, None)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return Prepared("completion", prompt_ids, params, body.n, body.cache_salt, body.stream, include_usage, False)

    def _token_budget(
        self, body: ChatCompletionRequest | CompletionRequest, prompt_tokens: int, max_tokens: int | None
    ) -> int:
        """``max_tokens`` checked against the batch size, the server's limit and the context left after the
        prompt (400s naming the field the request used: ``max_completion_tokens`` or ``max_tokens``), or the
        server's default that fits."""
        settings = self.settings
        field = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) is not None else "max_tokens"
        if body.n > settings.max_batch_size:
            raise ApiError(400, f"n={body.n} exceeds the server's max batch size {settings.max_batch_size}", param="n")
        room = self.engine.max_context - prompt_tokens if self.engine.max_context else None
        if room is not None and room < 1:  # the prompt alone: blame it, not the budget
            raise ApiError(
                400,
                f"prompt of {prompt_tokens} tokens fills the context of {self.engine.max_context} tokens: no room "
                "for a token",
                param="messages" if hasattr(body, "messages") else "prompt",
                code="context_length_exceeded",
            )
        limit = settings.max_tokens_limit
        if max_tokens is not None and limit is not None and max_tokens > limit:
            raise ApiError(400, f"{field}={max_tokens} exceeds this server's limit of {limit}", param=field)
        if max_tokens is None:
            max_tokens = min(settings.default_max_tokens, limit or settings.default_max_tokens, room or 2**31)
            max_tokens = max(max_tokens, 1)
        if room is not None and max_tokens > room:
            raise ApiError(
                400,
                f"prompt of {prompt_tokens} tokens + {field}={max_tokens} exceeds the context of "
                f"{self.engine.max_context} tokens",
                param=field,
                code="context_length_exceeded",
            )
        return max_tokens

    def _params(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        prompt_ids: list[int],
        max_tokens: int | None,
        top_logprobs: int | None,
        grammar: Compiled | None,
        tool_calls: bool = False,
    ) -> JobParams:
        """The job's settings; ``grammar`` constrains each row (a tool-call grammar when ``tool_calls``, whose rows
        also end a turn that repeats a call: :class:`~kvboost_hf.server.grammar.ToolCallProcessor`)."""
        max_tokens = self._token_budget(body, len(prompt_ids), max_tokens)
        if body.min_tokens > max_tokens:
            raise ApiError(400, f"min_tokens={body.min_tokens} exceeds max_tokens={max_tokens}", param="min_tokens")
        if grammar is not None and (body.min_tokens or body.ignore_eos):
            field = "min_tokens" if body.min_tokens else "ignore_eos"
            raise ApiError(400, f"{field} cannot be combined with response_format or tools", param=field)
        bias = {int(token): value for token, value in (body.logit_bias or {}).items()}
        self._check_token_ids(bias, "logit_bias")
        self._check_token_ids(body.stop_token_ids or [], "stop_token_ids")
        sampling = SamplingConfig(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=max(body.top_k, 0),
            min_p=body.min_p,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            logit_bias=tuple(sorted(bias.items())),
            min_tokens=body.min_tokens,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            seed=body.seed,
        )
        constraint: Callable[[int], LogitsProcessor] | None = None
        if grammar is not None:
            compiler = self._compiler()

            def constraint(prompt_length: int) -> LogitsProcessor:  # called once the grammar compiled
                if tool_calls:
                    return compiler.tool_call_processor(grammar.result(), prompt_length, self._decode, max_tokens)
                return compiler.processor(grammar.result(), prompt_length)

        return JobParams(
            max_tokens=max_tokens,
            sampling=sampling,
            stop=body.stop_strings(),
            top_logprobs=top_logprobs,
            constraint=constraint,
        )

    def _decode(self, tokens: list[int]) -> str:
        with self.worker.tokenizer_lock:
            return self.engine.tokenizer.decode(tokens)

    # ------------------------------------------------------------------ tools and prompts
    def _tool_mode(self, body: ChatCompletionRequest) -> tuple[list[Tool], bool, bool]:
        """``(tools offered, calls required, parallel calls allowed)``; a named choice allows one call of that tool."""
        if not body.tools:
            if body.tool_choice is not None:
                raise ApiError(400, "tool_choice needs tools", param="tool_choice")
            return [], False, False
        tools = [_tool(definition) for definition in body.tools]
        if len({tool.name for tool in tools}) != len(tools):
            raise ApiError(400, "tool names must be unique", param="tools")
        choice = body.tool_choice
        if choice is None or isinstance(choice, str):
            return tools, choice == "required", body.parallel_tool_calls
        named = [tool for tool in tools if tool.name == choice.function.name]
        if not named:
            raise ApiError(
                400, f"tool_choice names {choice.function.name!r}, which is not in tools", param="tool_choice"
            )
        return named, True, False  # a named function: exactly one call of it

    def _encode(self, text: str, param: str) -> list[int]:
        self._check_chars(len(text), param)
        try:
            return self.worker.encode(text)
        except ValueError as exc:
            raise ApiError(400, f"invalid prompt: {exc}", param=param) from exc

    def _encode_chat(
        self,
        messages: Sequence[ChatMessage],
        tools: list[Tool] | None,
        generation_prompt: bool,
        boundaries: DocumentBoundaries = DocumentBoundaries.NONE,
    ) -> tuple[list[int], list[int]]:
        """Token ids of the rendered messages and the segment starts ``boundaries`` marks (none with tools)."""
        self._check_chars(sum(len(m.text()) for m in messages), "messages")
        plain = not tools and not any(m.tool_calls or m.role == "tool" for m in messages)
        try:
            if plain:  # exactly the engine's rendering (greedy answers equal engine.generate)
                return self.worker.encode_segments(
                    plain_messages(messages), add_generation_prompt=generation_prompt, document_boundaries=boundaries
                )
            native = self._renders_tools()
            dicts = [_template_message(m, native) for m in messages]
            kwargs: dict[str, Any] = {}
            if tools and native:
                kwargs["tools"] = [_openai_tool(tool) for tool in tools]
            elif tools:
                dicts = _with_tool_prompt(dicts, tools)
            with self.worker.tokenizer_lock:
                tokenizer = self.engine.tokenizer
                text = tokenizer.apply_chat_template(
                    dicts, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
                )
                ids = self.engine.tokens.encode(text)  # pieces seen before come from the engine's token cache
        except TemplateError as exc:  # rendered here with tools: the template raised on the messages
            raise ApiError(400, f"invalid prompt: {TEMPLATE_REFUSED}: {exc}", param="messages") from exc
        except ValueError as exc:  # empty prompt, chat template refusing a role (InputError), ...
            raise ApiError(400, f"invalid prompt: {exc}", param="messages") from exc
        if not ids:
            raise ApiError(400, "invalid prompt: it renders to zero tokens", param="messages")
        return ids, []

    def _renders_tools(self) -> bool:
        """Whether the chat template renders a ``tools`` argument (checked once)."""
        with self._setup_lock:
            if self._template_renders_tools is None:
                probe = [{"role": "user", "content": "x"}]
                tool = _openai_tool(Tool("probe_tool", EMPTY_PARAMETERS, "probe"))
                with self.worker.tokenizer_lock:
                    render = self.engine.tokenizer.apply_chat_template
                    self._template_renders_tools = render(probe, tokenize=False, tools=[tool]) != render(
                        probe, tokenize=False
                    )
                logger.info("chat template renders tools: %s", self._template_renders_tools)
            return self._template_renders_tools

    def start(self) -> None:
        """Start the grammar compiler's processes (at the app's start, so that the first structured request does
        not wait for them; returns once they are starting)."""
        self._compiler().start()

    @property
    def structured_output(self) -> str:
        """``"ready"`` once the grammar compile processes are up, ``"starting"`` before, ``"idle"`` when nothing
        started them yet (they start with the app unless configured to start on first use)."""
        grammar = self._grammar
        if grammar is None:
            return "idle"
        return "ready" if grammar.started else "starting"

    def close(self) -> None:
        """End the grammar compiler's processes (at the app's shutdown)."""
        with self._setup_lock:
            if self._grammar is not None:
                self._grammar.close()
                self._grammar = None

    def _compiler(self) -> GrammarCompiler:
        with self._setup_lock:
            if self._grammar is None:
                with self.worker.tokenizer_lock:
                    self._grammar = GrammarCompiler(
                        self.engine.tokenizer, self.vocab_size, self.settings.grammar_limits
                    )
            return self._grammar

    # ------------------------------------------------------------------ checks
    def _check_model(self, model: str) -> None:
        if model != self.settings.model_name:
            raise ApiError(
                404,
                f"model {model!r} is not served here (try {self.settings.model_name!r})",
                param="model",
                code="model_not_found",
            )

    def _check_chars(self, chars: int, param: str) -> None:
        if self.max_prompt_chars is not None and chars > self.max_prompt_chars:
            raise ApiError(
                400,
                f"prompt of {chars} characters exceeds the context of {self.engine.max_context} tokens",
                param=param,
                code="context_length_exceeded",
            )

    def _check_token_ids(self, ids: Any, param: str) -> None:
        bad = [token for token in ids if not 0 <= token < self.vocab_size]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", param=param)


def client_address(request: Request) -> str:
    """Who a request's grammar compiles are counted against: its peer address (a proxy's clients share it; the
    ``cache_salt`` is chosen by the client, so it cannot be what its share is counted against)."""
    return request.client.host if request.client else ""


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark ``future``'s outcome as seen (asyncio logs exceptions nobody retrieved)."""
    if not future.cancelled():
        future.exception()


def _tool(definition: ToolDefinition) -> Tool:
    function = definition.function
    return Tool(function.name, function.parameters or EMPTY_PARAMETERS, function.description or "")


def _openai_tool(tool: Tool) -> dict[str, Any]:
    function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
    return {"type": "function", "function": function}


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _template_message(message: ChatMessage, native: bool) -> dict[str, Any]:
    """One history message as the chat template gets it (``native``: the template renders tools itself)."""
    text = message.text()
    if message.role == "tool":
        if native:
            return {"role": "tool", "content": text, "tool_call_id": message.tool_call_id}
        return {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}
    rendered: dict[str, Any] = {"role": engine_role(message.role), "content": text}
    if message.tool_calls:
        calls = [{"name": c.function.name, "arguments": _arguments(c.function.arguments)} for c in message.tool_calls]
        if native:
            rendered["tool_calls"] = [
                {"type": "function", "id": c.id, "function": f} for c, f in zip(message.tool_calls, calls, strict=True)
            ]
        else:
            rendered["content"] = text + "".join(f"{TOOL_CALL_BEGIN}{json.dumps(f)}{TOOL_CALL_END}" for f in calls)
    return rendered


def _with_tool_prompt(messages: list[dict[str, Any]], tools: list[Tool]) -> list[dict[str, Any]]:
    """The messages with :data:`TOOL_PROMPT` appended to the first system message (or added as one)."""
    listing = "\n".join(json.dumps(_openai_tool(tool)["function"]) for tool in tools)
    prompt = TOOL_PROMPT.format(tools=listing)
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]
