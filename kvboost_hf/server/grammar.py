"""Constrained decoding with xgrammar: JSON (any object or a schema) and tool calls, as a logits processor.

:class:`GrammarCompiler` compiles, once per constraint and tenant, the grammar of

* ``json_object``: any JSON object; ``json_schema``: JSON valid against a schema (compact, no free whitespace);
* tool calls in the Hermes tag format ``<tool_call>{"name": "NAME", "arguments": {...}}</tool_call>``, where the
  arguments follow the tool's parameter schema in the same compact JSON (:func:`compact_json_grammar`): ``auto``
  allows free text and dispatches into a call when the model writes ``<tool_call>``; ``required`` (and a named
  tool) allows nothing but calls.

:class:`GrammarProcessor` is a transformers ``LogitsProcessor`` for ONE row: before each step it feeds the
row's newly generated tokens to its matcher and masks every token the grammar forbids (the end tokens included
until the grammar is complete); :class:`ToolCallProcessor` also ends a turn whose model repeats a call.
:func:`parse_tool_calls` (a whole answer) and :class:`ToolCallStream` (a stream) read the calls back out of the
generated text by the same rules, so streamed and whole answers agree and markup never leaks.

Compiles run in the compiler's own child processes (:mod:`~kvboost_hf.server.grammar_process`, bounded by
``GrammarConfig``): a constraint source larger than ``max_schema_bytes`` is refused before compiling, a compile
running longer than ``compile_limit_s`` is killed (GrammarError: the size of a schema does not bound its compile
time), at most ``max_waiting`` compiles are queued or running (:class:`GrammarBusy` beyond), one client holds at
most ``max_waiting_per_client`` of them (:class:`GrammarQuota` beyond) and never runs on every worker, and compiled
grammars are cached per ``tenant`` (xgrammar's process-wide cache is off), so whether and when one tenant compiled a
schema never changes another tenant's compile time. Two identities: ``tenant`` (the ``cache_salt``) keys the
cache; ``client`` (the server passes the client's address: a salt chosen per request must not buy a client more
of the queue) is what the shares of the queue and of the workers are counted against (a caller that names no
client, e.g. a library user, has no queue share and its workers' share counted per ``tenant``). A compile whose child
process died is run once more on another child (:mod:`~kvboost_hf.server.grammar_process`). A schema that certainly
cannot compile (:mod:`~kvboost_hf.server.schema_check`, checked in this process) is GrammarError before any of
these bounds, so it is a 400 whatever the load, never a 503.

Invariant: a row constrained by a processor can only produce text the grammar accepts (or a prefix of it when its
token budget runs out first).
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar
from transformers import LogitsProcessor, PreTrainedTokenizerBase

from kvboost_hf.core.errors import KVBoostError, StateError
from kvboost_hf.core.values import check_bounds
from kvboost_hf.hf.detokenize import REPLACEMENT, IncrementalText
from kvboost_hf.server.grammar_process import CompileDied, CompileFailed, CompilePool, CompileProcess, CompileTimeout
from kvboost_hf.server.schema_check import MAX_DEPTH, certain_schema_problem

TOOL_CALL_BEGIN = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_ARGUMENTS_END = "}" + TOOL_CALL_END


def _call_header(name: str) -> str:
    """The fixed text the grammar forces before a call's arguments object."""
    return f'{TOOL_CALL_BEGIN}{{"name": {json.dumps(name)}, "arguments": '


_HEADER = re.compile(re.escape(_call_header("NAME")).replace("NAME", r"([A-Za-z0-9_-]+)"))


class GrammarError(KVBoostError, ValueError):
    """A schema or tool definition the grammar engine cannot compile, or one over the limits (the message names
    the problem): a client error."""


class GrammarBusy(KVBoostError, RuntimeError):
    """The compiler already has ``max_waiting`` compiles queued or running: retry later."""


class GrammarQuota(KVBoostError, RuntimeError):
    """This client already has ``max_waiting_per_client`` compiles queued or running (the message names the
    limit): retry once one is done."""


@dataclass(frozen=True)
class GrammarConfig:
    """Bounds of a :class:`GrammarCompiler`.

    Attributes:
        max_schema_bytes: largest constraint source in UTF-8 bytes (a schema's JSON text, or the tool-call
            structure with every tool's parameters).
        compile_timeout_s: how long a caller should wait for a compile, queueing included, in seconds (applied by
            the caller, e.g. the server's admission; the compile goes on in the background and is cached).
        compile_limit_s: longest compile in seconds (its process is killed and the constraint refused after).
        workers: compiles running at once, each in a child process; a client runs at most workers - 1.
            (1 worker: that one.)
        max_waiting: compiles queued or running.
        max_waiting_per_client: compiles one client may have queued or running (None: half of ``max_waiting``,
            at least 1). Behind a reverse proxy every client has its address: raise it there.
        cache_entries: compiled grammars kept, least recently used dropped first.
        start_with_server: start the compile processes when the server starts (else on the first structured
            request, which then waits for them: seconds the first time, when the fork server, or each child where
            there is none, imports xgrammar and torch).
    """

    max_schema_bytes: int = 32 << 10
    compile_timeout_s: float = 10.0
    compile_limit_s: float = 5.0
    workers: int = 2
    max_waiting: int = 4
    max_waiting_per_client: int | None = None
    cache_entries: int = 128
    start_with_server: bool = True

    def __post_init__(self) -> None:
        check_bounds(
            "GrammarConfig",
            [
                ("max_schema_bytes", self.max_schema_bytes, 1, False),
                ("compile_timeout_s", self.compile_timeout_s, 0, True),
                ("compile_limit_s", self.compile_limit_s, 0, True),
                ("workers", self.workers, 1, False),
                ("max_waiting", self.max_waiting, 1, False),
                ("max_waiting_per_client", self.max_waiting_per_client, 1, False),
                ("cache_entries", self.cache_entries, 1, False),
            ],
        )

    @property
    def client_share(self) -> int:
        """Compiles one client may have queued or running."""
        if self.max_waiting_per_client is not None:
            return self.max_waiting_per_client
        return max(1, self.max_waiting // 2)


@dataclass(frozen=True)
class Tool:
    """A callable function offered to the model: its name and the JSON schema of its arguments."""

    name: str
    parameters: dict[str, Any]
    description: str = ""


@dataclass(frozen=True)
class ToolCall:
    """One call read from generated text. ``arguments`` is the arguments' JSON text as generated; a call cut by
    the token budget has ``complete`` False and the arguments text generated before the cut (not valid JSON: the
    OpenAI API answers a call cut by ``max_tokens`` the same way)."""

    name: str
    arguments: str
    complete: bool = True


Compiled = Future[xgrammar.CompiledGrammar]


class GrammarCompiler:
    """Compiles constraints for one tokenizer on a bounded pool; thread-safe. ``vocab_size`` = the model's logit
    width. Each constraint method returns a future of the compiled grammar (done at once on a cache hit; its
    ``result()`` raises GrammarError when the constraint cannot be compiled) or raises GrammarError (over the
    limits), GrammarQuota (the client's share of the queue is full) or GrammarBusy (the queue is full) without
    compiling. ``tenant`` keys the cache, ``client`` is who the shares are counted against (see the module)."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, limits: GrammarConfig | None = None
    ) -> None:
        self.limits = limits or GrammarConfig()
        self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._pool = CompilePool(self.info, self.limits.workers)
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str | None, str], xgrammar.CompiledGrammar] = OrderedDict()
        self._waiting: dict[tuple[str | None, str], Compiled] = {}
        self._per_client: Counter[str | None] = Counter()  # compiles queued or running per client

    def json_object(self, *, tenant: str | None = None, client: str | None = None) -> Compiled:
        """Any JSON object."""
        return self.json_schema({"type": "object"}, tenant=tenant, client=client)

    def json_schema(self, schema: dict[str, Any], *, tenant: str | None = None, client: str | None = None) -> Compiled:
        """JSON valid against ``schema``, compact (:func:`compact_json_grammar`). A schema that certainly cannot
        compile (:func:`~kvboost_hf.server.schema_check.certain_schema_problem`) is GrammarError at once, whatever
        the load."""
        _refuse_if_certainly_invalid(schema, "schema")
        source = json.dumps(schema)
        return self._compile(tenant, client, f"json {source}", "json_schema", [source])

    def tool_calls(
        self,
        tools: Sequence[Tool],
        *,
        required: bool,
        parallel: bool,
        tenant: str | None = None,
        client: str | None = None,
    ) -> Compiled:
        """Calls of ``tools`` in the tag format; free text around them unless ``required``; at most one call
        unless ``parallel``."""
        if not tools:
            raise GrammarError("no tools to call")
        for i, tool in enumerate(tools):
            _refuse_if_certainly_invalid(tool.parameters, f"tools[{i}].function.parameters")
        source = json.dumps([[tool.name, tool.parameters] for tool in tools] + [required, parallel])
        jobs_tools = [[tool.name, tool.parameters, tool.description] for tool in tools]
        return self._compile(tenant, client, f"tags {source}", "tool_calls", [jobs_tools, required, parallel])

    def processor(self, grammar: xgrammar.CompiledGrammar, prompt_length: int) -> GrammarProcessor:
        """A fresh processor (own matcher state) for one row whose prompt has ``prompt_length`` tokens."""
        return GrammarProcessor(grammar, prompt_length, self.info.vocab_size)

    def tool_call_processor(
        self,
        grammar: xgrammar.CompiledGrammar,
        prompt_length: int,
        decode: Callable[[list[int]], str],
        max_new_tokens: int,
    ) -> ToolCallProcessor:
        """A fresh :class:`ToolCallProcessor` for one row of a :meth:`tool_calls` grammar with a budget of
        ``max_new_tokens``."""
        return ToolCallProcessor(grammar, prompt_length, self.info.vocab_size, decode, max_new_tokens)

    def start(self) -> None:
        """Start the compile processes now (returns at once; they are up seconds later)."""
        self._pool.start()

    @property
    def started(self) -> bool:
        """Whether the compile processes are up (see :meth:`wait_started`)."""
        return self._pool.started

    def wait_started(self) -> None:
        """Wait until the compile processes are up (seconds, once per compiler; see :class:`CompilePool`)."""
        self._pool.wait_started()

    def close(self) -> None:
        """Stop compiling: queued compiles are cancelled and the child processes end."""
        self._pool.close()

    def _compile(self, tenant: str | None, client: str | None, source: str, kind: str, args: list[Any]) -> Compiled:
        """The future of the grammar of compile job ``kind`` with ``args`` (in a child process:
        :mod:`~kvboost_hf.server.grammar_child`), cached under ``(tenant, source)``; one compile per key even when
        several callers ask at once; counted against ``client``'s share."""
        size = len(source.encode("utf-8", "surrogatepass"))
        if size > self.limits.max_schema_bytes:
            raise GrammarError(
                f"the constraint is {size} bytes of JSON, over this server's limit of {self.limits.max_schema_bytes}"
            )
        key = (tenant, source)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                done: Compiled = Future()
                done.set_result(self._cache[key])
                return done
            if key in self._waiting:
                return self._waiting[key]
            share = self.limits.client_share
            if client is not None and self._per_client[client] >= share:
                raise GrammarQuota(
                    f"this client already has {self._per_client[client]} grammar compiles waiting, its limit of "
                    f"{share} (max_waiting_per_client); retry once one is done"
                )
            if len(self._waiting) >= self.limits.max_waiting:
                raise GrammarBusy(f"{len(self._waiting)} grammar compiles are already waiting; retry later")
            worker_share = client if client is not None else tenant  # no client named: the tenant is
            running = self._pool.submit(worker_share, functools.partial(self._run, key, kind, args))
            future: Compiled = Future()
            self._waiting[key] = future
            self._per_client[client] += 1
        running.add_done_callback(functools.partial(self._finished, key, client, future))
        return future

    def _finished(
        self, key: tuple[str | None, str], client: str | None, future: Compiled, running: Future[Any]
    ) -> None:
        """Hand the pool's outcome to the caller's ``future`` (a child that died twice: GrammarError) and free the
        compile's places in the queue."""
        with self._lock:
            self._waiting.pop(key, None)
            self._per_client[client] -= 1
            if self._per_client[client] <= 0:
                del self._per_client[client]
        if running.cancelled():
            future.cancel()
        elif isinstance(exc := running.exception(), CompileDied):
            future.set_exception(GrammarError(f"the grammar compiler process died twice on the constraint ({exc})"))
        elif exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(running.result())

    def _run(
        self, key: tuple[str | None, str], kind: str, args: list[Any], process: CompileProcess
    ) -> xgrammar.CompiledGrammar:
        """One compile in ``process``: cached on success; GrammarError on failure or past the time limit,
        CompileDied when the child died."""
        limit = self.limits.compile_limit_s
        try:
            grammar = process.compile(kind, args, limit)
        except CompileDied:
            raise  # the pool runs it once more on another child
        except CompileFailed as exc:
            raise GrammarError(f"cannot compile the constraint: {exc}".strip()) from exc
        except CompileTimeout as exc:
            message = (
                f"the constraint did not compile within this server's limit of {limit:g} s (large repetition "
                "counts such as {1,30000} in patterns, or large length or item bounds, make compiles slow)"
            )
            raise GrammarError(message) from exc
        else:
            with self._lock:
                self._cache[key] = grammar
                while len(self._cache) > self.limits.cache_entries:
                    self._cache.popitem(last=False)
            return grammar


def _refuse_if_certainly_invalid(schema: Any, path: str) -> None:
    """GrammarError naming what makes ``schema`` certainly uncompilable (checked in this process, before any
    queue), if anything."""
    problem = certain_schema_problem(schema, path)
    if problem is not None:
        raise GrammarError(f"invalid schema: {problem}")


def compact_json_grammar(schema: dict[str, Any]) -> xgrammar.Grammar:
    """The grammar of JSON valid against ``schema`` written compactly: no whitespace but the single spaces of the
    separators ``", "`` and ``": "`` (as ``json.dumps`` writes them), so a model cannot pad or loop in whitespace.
    Used for ``json_schema`` answers and for tool-call arguments alike. Raises what xgrammar raises for a schema
    it cannot convert, and GrammarError for a required property that ``additionalProperties: false`` forbids."""
    return xgrammar.Grammar.from_json_schema(json.dumps(with_required_properties(schema)), any_whitespace=False)


_JSON_VALUES = ("const", "enum", "default", "examples")  # keywords whose values are JSON data, not schemas


def with_required_properties(node: Any, depth: int = 0) -> Any:
    """``node`` (a JSON schema) where every object lists each ``required`` name under ``properties``: xgrammar drops
    a required name it does not find there, so ``{"required": ["name"]}`` gave ``{}``, which fails the schema. A
    name added this way takes the object's ``additionalProperties`` schema (``{}``, any value, when that is absent
    or true), which is what the schema asks of it; ``additionalProperties: false`` makes the schema unsatisfiable
    (GrammarError naming the property). Nodes deeper than :data:`~.schema_check.MAX_DEPTH` are left as they are
    (their compile decides)."""
    if depth > MAX_DEPTH:
        return node
    if isinstance(node, list):
        return [with_required_properties(item, depth + 1) for item in node]
    if not isinstance(node, dict):
        return node
    out = {
        key: value if key in _JSON_VALUES else with_required_properties(value, depth + 1) for key, value in node.items()
    }
    properties, required = out.get("properties", {}), out.get("required", [])
    if not isinstance(properties, dict) or not isinstance(required, list):
        return out
    missing = [name for name in required if isinstance(name, str) and name not in properties]
    if missing:
        extra = out.get("additionalProperties", True)
        if extra is False:
            raise GrammarError(
                f"required property {missing[0]!r} is not in properties and additionalProperties is false: no JSON "
                "object satisfies the schema"
            )
        out["properties"] = {**properties, **{name: {} if extra is True else extra for name in missing}}
    return out


def tool_call_structure(tools: Sequence[Tool], required: bool, parallel: bool) -> str:
    """The xgrammar structural tag (JSON text) of calls of ``tools`` in the tag format, each call's arguments in
    the compact grammar of its parameter schema."""
    tags = [
        {
            "type": "tag",
            "begin": _call_header(tool.name),
            "content": {"type": "grammar", "grammar": str(compact_json_grammar(tool.parameters))},
            "end": _ARGUMENTS_END,
        }
        for tool in tools
    ]
    if required:
        layout = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True}
    else:
        layout = {"type": "triggered_tags", "triggers": [TOOL_CALL_BEGIN], "tags": tags}
    return json.dumps({"type": "structural_tag", "format": {**layout, "stop_after_first": not parallel}})


class GrammarProcessor(LogitsProcessor):
    """Masks the tokens ``grammar`` forbids for one row (``input_ids`` ``[1, L]``, prompt first). The end tokens
    stay masked until the grammar is complete, and once it is complete they are the only tokens allowed."""

    def __init__(self, grammar: xgrammar.CompiledGrammar, prompt_length: int, vocab_size: int) -> None:
        self.matcher = xgrammar.GrammarMatcher(grammar)
        self.prompt_length = prompt_length
        self.generated: list[int] = []  # the row's generated tokens, each read from ``input_ids`` once
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        new = input_ids[0, self.prompt_length + len(self.generated) :].tolist()  # host work per token: O(new)
        for token in new:
            if not self.matcher.accept_token(token):
                raise StateError(f"token {token} violates the grammar (the mask was bypassed)")
        self.generated += new
        self.matcher.fill_next_token_bitmask(self.bitmask)
        masked = scores.clone()
        xgrammar.apply_token_bitmask_inplace(masked, self.bitmask.to(masked.device))
        return masked


class ToolCallProcessor(GrammarProcessor):
    """A :class:`GrammarProcessor` for tool calls that also ends the turn when the model starts looping: once the
    generated text holds a complete call equal to an earlier call of the turn, only end tokens are allowed (when
    the grammar allows ending there), and that repeat is dropped when the calls are read (:func:`_read`). A
    model that keeps repeating its call under ``tool_choice="required"`` thus ends with ``finish_reason
    "tool_calls"``, as OpenAI models do, instead of running out of tokens.

    Budget: once a call is complete, the turn also ends when the ``max_new_tokens`` left are fewer than the tokens
    the shortest complete call of the turn took (counted from the end of the call before it, the first from the
    start of the answer): a further call, most often the model's repeat, could not complete, and the answer would
    end with ``finish_reason "length"`` around complete calls. ``decode``: generated token ids -> text, safe to call
    from the decoding thread.

    Host work per token does not grow with the answer: the text is detokenized incrementally
    (:class:`~kvboost_hf.hf.detokenize.IncrementalText`), and it is read for calls (:func:`_read`) only when it
    holds a new end of call (``}</tool_call>``): the grammar puts one after every call before the turn may end, so
    the count of complete calls and a repeat can only change there."""

    def __init__(
        self,
        grammar: xgrammar.CompiledGrammar,
        prompt_length: int,
        vocab_size: int,
        decode: Callable[[list[int]], str],
        max_new_tokens: int,
    ) -> None:
        super().__init__(grammar, prompt_length, vocab_size)
        self.decode = decode
        self.max_new_tokens = max_new_tokens
        self.end_token_ids = list(grammar.tokenizer_info.stop_token_ids)
        self.complete_calls = 0  # complete calls read so far
        self.last_call_end = 0  # generated tokens when the last of them was first seen complete
        self.shortest_call: int | None = None  # fewest tokens a complete call of this turn took
        self.text = IncrementalText()
        self.scanned = (
            0  # text offset from which a new end of call may still start (the settled text before it had none new)
        )
        self.repeated = False  # that reading found a repeated call

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        masked = super().__call__(input_ids, scores)
        ends = torch.full_like(masked, -float("inf"))
        ends[:, self.end_token_ids] = masked[:, self.end_token_ids]
        if not torch.isfinite(ends).any():  # the grammar does not allow ending here: nothing to decide
            return masked
        generated = len(self.generated)
        self.text.update(self.generated, self.decode)
        text = self.text.text
        new_call_end = text.find(_ARGUMENTS_END, self.scanned) >= 0  # only the new text is searched
        settled = len(text.rstrip(REPLACEMENT))  # a pending (incomplete) character may still change
        self.scanned = max(self.scanned, settled - len(_ARGUMENTS_END) + 1)
        if new_call_end:
            reading = _read(text, final=False)
            self.repeated = reading.repeated
            complete = sum(call.complete for call in reading.calls)
            if complete > self.complete_calls:  # one call per step while decoding; several share the span evenly
                span = (generated - self.last_call_end) // (complete - self.complete_calls)
                self.shortest_call = span if self.shortest_call is None else min(self.shortest_call, span)
                self.complete_calls, self.last_call_end = complete, generated
        no_room = self.shortest_call is not None and self.max_new_tokens - generated < self.shortest_call
        return ends if self.repeated or no_room else masked


@dataclass(frozen=True)
class _Reading:
    """What generated text in the tag format holds so far (see :func:`_read`)."""

    content: str
    calls: list[ToolCall]
    repeated: bool  # a complete call equal to an earlier one was dropped


def _read(text: str, final: bool) -> _Reading:
    """Read generated text in the tag format; ``final``: the text is complete (finished or cut), else more may come.

    The one reading behind whole answers and streams, so both always agree:

    * content is the text before the first call, without trailing whitespace when a call follows. A trailing start
      of ``<tool_call>`` is never content, and while not final trailing whitespace waits (a call may follow);
    * text after the first call that is not a call (separators, free text in ``auto`` mode) is dropped;
    * a call is reported once its name is complete. Its arguments are the JSON value after the name, found by a
      string-aware scan: markup never enters them (a cut ``}</tool`` included), and ``</tool_call>`` inside a
      string value stays part of it;
    * a complete call equal (name and argument text) to an earlier one of the turn is dropped (``repeated``), and
      so is an incomplete call whose arguments so far are a prefix of an earlier call's of the same name: it may
      still become a repeat (reported once it differs; dropped if the text ends there).
    """
    first = text.find(TOOL_CALL_BEGIN)
    if first < 0:
        content = text[: len(text) - _held_back(text, TOOL_CALL_BEGIN)]
        return _Reading(content if final else content.rstrip(), [], False)
    calls: list[ToolCall] = []
    repeated = False
    start = first
    while start >= 0 and (header := _HEADER.match(text, start)) is not None:
        end = _json_value_end(text, header.end())
        call = ToolCall(header.group(1), text[header.end() : end], end is not None)
        if call.complete and call in calls:
            repeated = True
        elif call.complete or not any(_may_become(call, earlier) for earlier in calls):
            calls.append(call)
        if end is None:
            break
        start = text.find(TOOL_CALL_BEGIN, end)
    return _Reading(text[:first].rstrip(), calls, repeated)


def _may_become(call: ToolCall, earlier: ToolCall) -> bool:
    """Whether the incomplete ``call`` may still end up equal to the complete ``earlier`` one."""
    return earlier.complete and earlier.name == call.name and earlier.arguments.startswith(call.arguments)


def _json_value_end(text: str, start: int) -> int | None:
    """End index of the JSON value starting at ``text[start]``, None while it is incomplete. Characters inside
    strings (escapes included) never count as structure; a scalar value ends at the call's closing ``}``."""
    depth, in_string, escaped = 0, False, False
    for index in range(start, len(text)):
        char = text[index]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
                if depth == 0:
                    return index + 1
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            if depth == 0:
                return index
            depth -= 1
            if depth == 0:
                return index + 1
    return None


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """``(content, calls)`` of a complete generated text in the tag format (the rules of :func:`_read`)."""
    reading = _read(text, final=True)
    return reading.content, reading.calls


@dataclass(frozen=True)
class ToolCallDelta:
    """New text of call ``index``: its ``name`` on the first delta of the call (else None), then argument text."""

    index: int
    name: str | None
    arguments: str


class ToolCallStream:
    """Incremental reading of a growing generated text in the tag format: the new content and call deltas since
    the last update, by the same rules as :func:`parse_tool_calls` (once ``final``, everything sent adds up to
    its answer). ``update`` is given the whole text so far each time."""

    def __init__(self) -> None:
        self.content_sent = 0
        self.arguments_sent: list[int] = []
        self.calls_complete = False  # the last reading had calls, each of them complete

    def update(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """``(new content, new call deltas)``; with ``final`` nothing is held back any more."""
        reading = _read(text, final)
        self.calls_complete = bool(reading.calls) and all(call.complete for call in reading.calls)
        new_content = reading.content[self.content_sent :]
        self.content_sent = max(self.content_sent, len(reading.content))
        deltas: list[ToolCallDelta] = []
        for index, call in enumerate(reading.calls):
            if index == len(self.arguments_sent):
                self.arguments_sent.append(0)
                deltas.append(ToolCallDelta(index, call.name, ""))
            if len(call.arguments) > self.arguments_sent[index]:
                deltas.append(ToolCallDelta(index, None, call.arguments[self.arguments_sent[index] :]))
                self.arguments_sent[index] = len(call.arguments)
        return new_content, deltas


def _held_back(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of ``marker`` (it may still become it)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0
