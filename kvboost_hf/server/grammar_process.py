"""Grammar compiles in child processes with a hard time limit, scheduled so that no tenant holds every worker.

xgrammar's compile cannot be interrupted, and its time is not bounded by the constraint's size (a 46-byte schema
``{"type": "string", "pattern": "[a-z]{1,30000}"}`` compiles for minutes). So each compile runs in a child
process (:class:`CompileProcess`: a fresh interpreter, never a fork of the server's threads nor a re-run of its
``__main__`` as multiprocessing would do) killed when the compile passes its time limit, and replaced at once
(the new one starts in the background: it imports xgrammar, and so torch, in a few seconds); the compiled grammar
comes back as xgrammar's JSON serialisation. A child that dies on a constraint (a crash inside xgrammar) costs
that request only: a job whose child died (a crash, or killed from outside: the OOM killer, an operator) is
queued again once, in front, for the next worker with a live child; a second death fails it.

:class:`CompilePool` runs jobs on ``workers`` threads, each driving one child. Invariant: a tenant runs at most
``max(1, workers - 1)`` compiles at once (its further jobs wait, in arrival order), so with two or more workers
one is always left to the other tenants, and each job holds its worker at most ``time_limit_s``. A worker whose
child was killed or died waits for its new child before it takes the next job, so a restart (seconds: the child
imports xgrammar and torch) never delays a job that another worker can run now.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import xgrammar

from kvboost_hf.core.errors import ConfigError, KVBoostError, StateError

logger = logging.getLogger(__name__)
T = TypeVar("T")
CHILD_START_TIMEOUT_S = 120.0  # a child imports xgrammar (and torch) before its first answer
LIVENESS_S = 0.5  # how often an idle worker looks at its child


class CompileTimeout(KVBoostError, RuntimeError):
    """A compile ran past its time limit; its child process was killed."""


class CompileFailed(KVBoostError, RuntimeError):
    """The constraint could not be compiled (xgrammar's message), or the child died compiling it."""


class CompileDied(CompileFailed):
    """The child died (or its pipe broke) before answering; a new child is starting. The pool runs the job once
    more on another child before failing it with this."""


class _ChildExited(KVBoostError, OSError):
    """The child closed its answer pipe: it exited (internal; the caller restarts it and raises CompileDied)."""


class CompileProcess:
    """One child process (``python -m kvboost_hf.server.grammar_child``) compiling for one tokenizer: ``info``, also
    written as xgrammar's JSON at ``tokenizer_path`` for the child to read. Jobs and answers are JSON lines on its
    stdin and stdout (:mod:`~kvboost_hf.server.grammar_child`). Used by one thread at a time."""

    def __init__(self, info: xgrammar.TokenizerInfo, tokenizer_path: Path) -> None:
        self.info, self.tokenizer_path = info, tokenizer_path
        self._closed = False
        self._start()

    def _start(self) -> None:
        package_root = str(Path(__file__).resolve().parents[2])  # the child imports this copy of kvboost_hf
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (package_root, os.environ.get("PYTHONPATH"))))}
        self._child = subprocess.Popen(
            [sys.executable, "-m", "kvboost_hf.server.grammar_child", str(self.tokenizer_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self._ready = False

    def compile(self, kind: str, args: list[Any], time_limit_s: float) -> xgrammar.CompiledGrammar:
        """The grammar of job ``kind`` with JSON ``args`` (see the child module), compiled in the child within
        ``time_limit_s`` seconds (CompileTimeout after: the child is killed and a new one started). Raises
        CompileFailed when it cannot compile."""
        try:
            self.wait_ready()
            assert self._child.stdin is not None
            self._child.stdin.write(json.dumps({"kind": kind, "args": args}).encode() + b"\n")
            self._child.stdin.flush()
            answer = self._receive(time_limit_s)
        except CompileTimeout:
            self._restart()
            raise
        except (OSError, ValueError) as exc:  # a closed pipe, or a line cut by the child's death
            self._restart()
            raise CompileDied(f"the grammar compiler process died ({exc or type(exc).__name__})") from exc
        if answer["status"] != "ok":
            raise CompileFailed(answer["message"])
        return xgrammar.CompiledGrammar.deserialize_json(answer["grammar"], self.info)

    @property
    def ready(self) -> bool:
        """Whether the current child has answered its first line."""
        return self._ready

    @property
    def pid(self) -> int:
        """The current child's process id."""
        return self._child.pid

    @property
    def alive(self) -> bool:
        """Whether the current child is still running (it may have been killed while idle)."""
        return self._child.poll() is None

    def wait_ready(self) -> None:
        """Wait (at most CHILD_START_TIMEOUT_S) for the child to have started (its first line)."""
        if not self._ready:
            self._receive(CHILD_START_TIMEOUT_S)
            self._ready = True

    def _receive(self, timeout_s: float) -> dict[str, Any]:
        """The child's next answer line, its first byte within ``timeout_s``."""
        stdout = self._child.stdout
        assert stdout is not None
        readable, _, _ = select.select([stdout], [], [], timeout_s)
        if not readable:
            raise CompileTimeout(f"no answer within {timeout_s:g} s")
        line = stdout.readline()
        if not line:
            raise _ChildExited(f"the child exited with status {self._child.wait(10)}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def restart(self) -> None:
        """Replace the child by a new one (not waited for: see :meth:`wait_ready`)."""
        self._restart()

    def _restart(self) -> None:
        self._stop()
        if not self._closed:
            self._start()

    def close(self) -> None:
        """Kill the child (a compile in flight fails) and start no other."""
        self._closed = True
        self._stop()

    def _stop(self) -> None:
        """Kill the child and close its pipes; a child already dead (its pipe broken: closing stdin flushes into
        it) is not an error."""
        self._child.kill()
        self._child.wait(10)
        for stream in (self._child.stdin, self._child.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


class CompilePool:
    """Runs compile jobs on ``workers`` threads, each with its own :class:`CompileProcess` (started on first use),
    fairly across tenants (see the module); thread-safe."""

    def __init__(self, info: xgrammar.TokenizerInfo, workers: int) -> None:
        if workers < 1:
            raise ConfigError(f"workers must be >= 1, got {workers}")
        self.info = info
        self.workers = workers
        self.per_tenant = max(1, workers - 1)
        self._files: tempfile.TemporaryDirectory[str] | None = None  # holds the tokenizer's JSON for the children
        self._cond = threading.Condition()
        self._queue: list[_Job] = []
        self._running: Counter[str | None] = Counter()
        self._threads: list[threading.Thread] = []
        self._processes: list[CompileProcess] = []
        self._closed = False
        self._started = threading.Event()  # every worker's first child answered (or failed to start)
        self._starting = 0  # workers whose first child has not answered yet

    def start(self) -> None:
        """Start the workers and their child processes (once; returns at once, see :meth:`wait_started`)."""
        with self._cond:
            if self._files is not None or self._closed:
                return
            self._files = tempfile.TemporaryDirectory(prefix="kvboost-grammar-")
            self._tokenizer_path().write_text(self.info.serialize_json(), encoding="utf-8")
            self._starting = self.workers
            for index in range(self.workers):
                thread = threading.Thread(target=self._work, name=f"kvboost-grammar-{index}", daemon=True)
                self._threads.append(thread)
                thread.start()

    @property
    def started(self) -> bool:
        """Whether every worker's first child has answered (or failed to start): compiles no longer wait for them."""
        return self._started.is_set()

    def wait_started(self, timeout_s: float = CHILD_START_TIMEOUT_S) -> None:
        """Start the workers if needed and wait until their children are up (seconds, once per pool: each imports
        xgrammar and torch), so that a caller's compile wait measures compiling only."""
        self.start()
        self._started.wait(timeout_s)

    def submit(self, tenant: str | None, job: Callable[[CompileProcess], T]) -> Future[T]:
        """Queue ``job`` (run with a worker's process) for ``tenant``; its future holds the result or exception."""
        future: Future[T] = Future()
        with self._cond:
            if self._closed:
                raise StateError("the grammar compile pool is closed")
        self.start()
        with self._cond:
            self._queue.append(_Job(tenant, job, future))
            self._cond.notify_all()
        return future

    def close(self) -> None:
        """Kill every child (a compile in flight fails) and stop the workers; queued jobs are cancelled."""
        with self._cond:
            self._closed = True
            for queued in self._queue:
                queued.future.cancel()
            self._queue.clear()
            self._cond.notify_all()
        with self._cond:
            processes = list(self._processes)
        for process in processes:  # a compile in flight fails at once (its caller gets an error)
            process.close()
        for thread in self._threads:
            thread.join(30)
        if self._files is not None:
            self._files.cleanup()

    def _tokenizer_path(self) -> Path:
        assert self._files is not None
        return Path(self._files.name) / "tokenizer_info.json"

    def _next_job(self, process: CompileProcess) -> _Job | None:
        """The oldest queued job whose tenant runs fewer than ``per_tenant`` compiles (None once closed). While
        waiting, ``process``'s child is looked at every :data:`LIVENESS_S`: one killed while idle is replaced
        (and waited for) before this worker takes a job, so the job goes to a worker whose child is up."""
        with self._cond:
            while not self._closed:
                if not process.alive:
                    self._cond.release()
                    try:
                        logger.warning("a grammar compile process died while idle; starting another")
                        process.restart()
                        self._ready(process)
                    finally:
                        self._cond.acquire()
                    continue
                for index, queued in enumerate(self._queue):
                    if self._running[queued.tenant] < self.per_tenant:
                        self._running[queued.tenant] += 1
                        return self._queue.pop(index)
                self._cond.wait(LIVENESS_S)
            return None

    def _ready(self, process: CompileProcess) -> None:
        """Wait for ``process``'s child before taking a job (a failed start: its first job restarts it; at
        close, the children are killed on purpose)."""
        try:
            process.wait_ready()
        except (CompileTimeout, OSError, ValueError) as exc:
            if not self._closed:
                logger.error("a grammar compile process did not start: %s", exc)

    def _work(self) -> None:
        process = CompileProcess(self.info, self._tokenizer_path())
        with self._cond:
            self._processes.append(process)
        self._ready(process)
        with self._cond:
            self._starting -= 1
            if self._starting == 0:
                self._started.set()
        while (queued := self._next_job(process)) is not None:
            logger.debug("%s: a compile of %s (child %d)", threading.current_thread().name, queued.tenant, process.pid)
            again = False
            try:
                if queued.retried or queued.future.set_running_or_notify_cancel():
                    try:
                        queued.future.set_result(queued.job(process))
                    except CompileDied as exc:
                        again = not queued.retried
                        if not again:
                            queued.future.set_exception(exc)
                    except BaseException as exc:  # the job's failure belongs to its caller
                        queued.future.set_exception(exc)
            finally:
                with self._cond:
                    self._running[queued.tenant] -= 1
                    if self._running[queued.tenant] <= 0:
                        del self._running[queued.tenant]
                    if again and not self._closed:  # in front, for a worker whose child is up
                        self._queue.insert(0, _Job(queued.tenant, queued.job, queued.future, retried=True))
                    elif again:
                        queued.future.set_exception(CompileDied("the grammar compile pool closed"))
                    self._cond.notify_all()
            if not process.ready:  # killed or died: wait for the new child before taking another job
                self._ready(process)


@dataclass(frozen=True)
class _Job:
    """A queued compile: its tenant, the job (run with a worker's process), its future, and whether it already
    ran once on a child that died."""

    tenant: str | None
    job: Callable[[CompileProcess], Any]
    future: Future[Any]
    retried: bool = False
