"""A grammar compile process (``python -m kvboost_hf.server.grammar_child TOKENIZER_JSON_PATH``), started and killed
by :class:`~kvboost_hf.server.grammar_process.CompileProcess`.

Protocol, one JSON object per line: the child first writes ``{"status": "ready"}``; then for each job line
``{"kind": "json_schema", "args": [schema JSON text]}`` or ``{"kind": "tool_calls", "args": [[[name, parameters,
description], ...], required, parallel]}`` it writes ``{"status": "ok", "grammar": xgrammar's serialisation}`` or
``{"status": "error", "message": ...}``. It exits when its stdin closes.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xgrammar

from kvboost_hf.server.grammar import Tool, compact_json_grammar, tool_call_structure


def _json_schema(compiler: xgrammar.GrammarCompiler, schema_json: str) -> xgrammar.CompiledGrammar:
    return compiler.compile_grammar(compact_json_grammar(json.loads(schema_json)))


def _tool_calls(
    compiler: xgrammar.GrammarCompiler, tools: list[list[Any]], required: bool, parallel: bool
) -> xgrammar.CompiledGrammar:
    return compiler.compile_structural_tag(tool_call_structure([Tool(*tool) for tool in tools], required, parallel))


BUILDS: dict[str, Callable[..., xgrammar.CompiledGrammar]] = {"json_schema": _json_schema, "tool_calls": _tool_calls}


def _answer(line: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()


def main(tokenizer_path: str) -> None:
    info = xgrammar.TokenizerInfo.deserialize_json(Path(tokenizer_path).read_text(encoding="utf-8"))
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    _answer({"status": "ready"})
    for line in sys.stdin:
        try:
            job = json.loads(line)
            grammar = BUILDS[job["kind"]](compiler, *job["args"])
        except Exception as exc:  # every failure of a constraint is reported, the child goes on
            _answer({"status": "error", "message": f"{type(exc).__name__}: {exc}"})
        else:
            _answer({"status": "ok", "grammar": grammar.serialize_json()})


if __name__ == "__main__":
    main(sys.argv[1])
