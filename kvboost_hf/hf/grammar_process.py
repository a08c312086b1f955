"""Grammar compiles in child processes with a hard time limit, scheduled so that no tenant holds every worker.

xgrammar's compile cannot be interrupted, and its time is not bounded by the constraint's size (a 46-byte schema
``{"type": "string", "pattern": "[a-z]{1,30000}"}`` compiles for minutes). So each compile runs in a child
process (:class:`CompileProcess`, started with ``spawn``: the server process holds threads) that is killed when
the compile passes its time limit, and replaced at once; the compiled grammar comes back as xgrammar's JSON
serialisation. A child that dies on a constraint (a crash inside xgrammar) costs that request only.

:class:`CompilePool` runs jobs on ``workers`` threads, each driving one child. Invariant: a tenant runs at most
``max(1, workers - 1)`` compiles at once (its further jobs wait, in arrival order), so with two or more workers
one is always left to the other tenants, and each job holds its worker at most ``time_limit_s`` (plus the child's
start after a kill, which is not counted against the next job's limit).
"""

from __future__ import annotations

import logging
import multiprocessing
import tempfile
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, TypeVar

import xgrammar

logger = logging.getLogger(__name__)
T = TypeVar("T")
Build = Callable[..., xgrammar.CompiledGrammar]  # module-level (picklable): (compiler, *args) -> grammar
CHILD_START_TIMEOUT_S = 120.0  # a child imports xgrammar (and torch) before its first compile


class CompileTimeout(RuntimeError):
    """A compile ran past its time limit; its child process was killed."""


class CompileFailed(RuntimeError):
    """The constraint could not be compiled (xgrammar's message), or the child died compiling it."""


def _serve(conn: Connection, tokenizer_path: str) -> None:
    """The child's loop: build the compiler from the tokenizer's JSON file, then answer ``(build, args)`` jobs with
    ``("ok", grammar JSON)`` or ``("error", message)`` until the parent closes the pipe."""
    info = xgrammar.TokenizerInfo.deserialize_json(Path(tokenizer_path).read_text(encoding="utf-8"))
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    conn.send(("ready", ""))
    while True:
        try:
            build, args = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", build(compiler, *args).serialize_json()))
        except Exception as exc:  # every failure of a constraint is reported, the child goes on
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class CompileProcess:
    """One child process compiling for one tokenizer (``info``, also written as xgrammar's JSON at
    ``tokenizer_path``: a file, so that starting a child never blocks on a pipe while it imports); used by one
    thread at a time."""

    def __init__(self, info: xgrammar.TokenizerInfo, tokenizer_path: Path) -> None:
        self.info, self.tokenizer_path = info, tokenizer_path
        self._ready = False
        self._start()

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child_end = context.Pipe()
        self._process = context.Process(
            target=_serve, args=(child_end, str(self.tokenizer_path)), name="kvboost-grammar-compile", daemon=True
        )
        self._process.start()
        child_end.close()
        self._ready = False

    def compile(self, build: Build, args: tuple[Any, ...], time_limit_s: float) -> xgrammar.CompiledGrammar:
        """``build(compiler, *args)`` in the child, within ``time_limit_s`` seconds of compile time (CompileTimeout
        after: the child is killed and a new one started). Raises CompileFailed when it cannot compile."""
        try:
            if not self._ready:
                self._receive(CHILD_START_TIMEOUT_S)  # the "ready" message
                self._ready = True
            self._conn.send((build, args))
            status, payload = self._receive(time_limit_s)
        except CompileTimeout:
            self._restart()
            raise
        except (EOFError, OSError) as exc:
            self._restart()
            raise CompileFailed(f"the grammar compiler process died ({exc or type(exc).__name__})") from exc
        if status != "ok":
            raise CompileFailed(payload)
        return xgrammar.CompiledGrammar.deserialize_json(payload, self.info)

    def _receive(self, timeout_s: float) -> tuple[str, str]:
        if not self._conn.poll(timeout_s):
            raise CompileTimeout(f"no answer within {timeout_s:g} s")
        message: tuple[str, str] = self._conn.recv()
        return message

    def _restart(self) -> None:
        self.close()
        self._start()

    def close(self) -> None:
        """Kill the child (a compile in flight is lost) and wait for it to end."""
        self._conn.close()
        if self._process.is_alive():
            self._process.kill()
        self._process.join(10)


class CompilePool:
    """Runs compile jobs on ``workers`` threads, each with its own :class:`CompileProcess` (started on first use),
    fairly across tenants (see the module); thread-safe."""

    def __init__(self, info: xgrammar.TokenizerInfo, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.info = info
        self.workers = workers
        self.per_tenant = max(1, workers - 1)
        self._files: tempfile.TemporaryDirectory[str] | None = None  # holds the tokenizer's JSON for the children
        self._cond = threading.Condition()
        self._queue: list[tuple[str | None, Callable[[CompileProcess], Any], Future[Any]]] = []
        self._running: Counter[str | None] = Counter()
        self._threads: list[threading.Thread] = []
        self._processes: list[CompileProcess] = []
        self._closed = False

    def submit(self, tenant: str | None, job: Callable[[CompileProcess], T]) -> Future[T]:
        """Queue ``job`` (run with a worker's process) for ``tenant``; its future holds the result or exception."""
        future: Future[T] = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the grammar compile pool is closed")
            if self._files is None:
                self._files = tempfile.TemporaryDirectory(prefix="kvboost-grammar-")
                self._tokenizer_path().write_text(self.info.serialize_json(), encoding="utf-8")
                for index in range(self.workers):
                    thread = threading.Thread(target=self._work, name=f"kvboost-grammar-{index}", daemon=True)
                    self._threads.append(thread)
                    thread.start()
            self._queue.append((tenant, job, future))
            self._cond.notify_all()
        return future

    def close(self) -> None:
        """Stop the workers after their current job and kill every child; queued jobs are cancelled."""
        with self._cond:
            self._closed = True
            for _, _, future in self._queue:
                future.cancel()
            self._queue.clear()
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(30)
        for process in self._processes:
            process.close()
        if self._files is not None:
            self._files.cleanup()

    def _tokenizer_path(self) -> Path:
        assert self._files is not None
        return Path(self._files.name) / "tokenizer_info.json"

    def _next_job(self) -> tuple[str | None, Callable[[CompileProcess], Any], Future[Any]] | None:
        """The oldest queued job whose tenant runs fewer than ``per_tenant`` compiles (None once closed)."""
        with self._cond:
            while not self._closed:
                for index, (tenant, _, _) in enumerate(self._queue):
                    if self._running[tenant] < self.per_tenant:
                        self._running[tenant] += 1
                        return self._queue.pop(index)
                self._cond.wait()
            return None

    def _work(self) -> None:
        process = CompileProcess(self.info, self._tokenizer_path())
        with self._cond:
            self._processes.append(process)
        while (item := self._next_job()) is not None:
            tenant, job, future = item
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(job(process))
                    except BaseException as exc:  # the job's failure belongs to its caller
                        future.set_exception(exc)
            finally:
                with self._cond:
                    self._running[tenant] -= 1
                    if self._running[tenant] <= 0:
                        del self._running[tenant]
                    self._cond.notify_all()
