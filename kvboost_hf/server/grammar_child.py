"""A grammar compile process, started and killed by :class:`~kvboost_hf.server.grammar_process.CompileProcess`:
forked by the fork server (``python -m kvboost_hf.server.grammar_child --fork-server FD``) or, where a fork
server is not available, a fresh interpreter (``python -m kvboost_hf.server.grammar_child TOKENIZER_JSON_PATH``).

Protocol, one JSON object per line: the child first writes ``{"status": "ready"}``; then for each job line
``{"kind": "json_schema", "args": [schema JSON text]}`` or ``{"kind": "tool_calls", "args": [[[name, parameters,
description], ...], required, parallel]}`` it writes ``{"status": "ok", "grammar": xgrammar's serialisation}`` or
``{"status": "error", "message": ...}``. It exits when its stdin closes.

The fork server imports xgrammar (and with it torch: seconds of CPU and ~250 MB) once; each compile process is then
a fork of it (milliseconds, its memory shared until written), so replacing a child killed past its time limit
costs no import. Protocol on its control socket (``AF_UNIX``, ``SOCK_SEQPACKET``: one message each): it first
sends ``ready``; then for each message holding a tokenizer JSON path and two file descriptors (the child's
stdin and stdout) it forks a child running :func:`main` on them and answers the child's process id; it exits when
the socket closes. It never runs a compile itself, never starts a thread and never touches a device, so every fork
starts from one clean, single-threaded state. The kernel reaps its children (``SIGCHLD`` ignored).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

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


def serve_forks(control: socket.socket) -> None:
    """The fork server's loop on ``control`` (see the module); returns when the socket closes."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # no zombies: the kernel reaps the children
    control.send(b"ready")
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(control, 4096, 2)
        except OSError:
            return
        if not message:
            return
        pid = os.fork()
        if pid == 0:
            _run_forked(control, os.fsdecode(message), fds)
        for fd in fds:
            os.close(fd)
        control.send(str(pid).encode())


def _run_forked(control: socket.socket, tokenizer_path: str, fds: list[int]) -> NoReturn:
    """In a forked child: :func:`main` on the received stdin and stdout, then exit."""
    status = 1
    try:
        control.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        stdin, stdout = fds
        os.dup2(stdin, 0)
        os.dup2(stdout, 1)
        for fd in fds:
            os.close(fd)
        main(tokenizer_path)
        status = 0
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # a pipe the server already closed
                stream.flush()
        os._exit(status)


if __name__ == "__main__":
    if sys.argv[1] == "--fork-server":
        serve_forks(socket.socket(fileno=int(sys.argv[2])))
    else:
        main(sys.argv[1])
