"""Grammar compiles in child processes with a hard time limit, scheduled so that no tenant holds every worker.

xgrammar's compile cannot be interrupted, and its time is not bounded by the constraint's size (a 46-byte schema
``{"type": "string", "pattern": "[a-z]{1,30000}"}`` compiles for minutes). So each compile runs in a child
process (:class:`CompileProcess`) killed when the compile passes its time limit, and replaced at once. On Linux a
child is a fork of one template process per server process (the fork server of
:mod:`~kvboost_hf.server.grammar_child`, started on first use: it imports xgrammar, and so torch, once), so a
replacement costs milliseconds and no import, and the children share the template's memory; never a fork of the
server's threads nor a re-run of its ``__main__`` as multiprocessing would do. Elsewhere (no pidfds or descriptor
passing) each child is a fresh interpreter that imports xgrammar itself, in a few seconds. The compiled grammar
comes back as xgrammar's JSON serialisation. A child that dies on a constraint (a crash inside xgrammar) costs
that request only: a job whose child died (a crash, or killed from outside: the OOM killer, an operator) is
queued again once, in front, for the next worker with a live child; a second death fails it.

:class:`CompilePool` runs jobs on ``workers`` threads, each driving one child. Invariant: a tenant runs at most
``max(1, workers - 1)`` compiles at once (its further jobs wait, in arrival order), so with two or more workers
one is always left to the other tenants, and each job holds its worker at most ``time_limit_s``. A worker whose
child was killed or died waits for its new child before it takes the next job, so a restart (seconds where the
child imports xgrammar and torch itself) never delays a job that another worker can run now.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol, TypeVar

import xgrammar

from kvboost_hf.core.errors import ConfigError, KVBoostError, StateError

logger = logging.getLogger(__name__)
T = TypeVar("T")
CHILD_START_TIMEOUT_S = 120.0  # a child (or the fork server) imports xgrammar (and torch) before its first answer
FORK_TIMEOUT_S = 30.0  # the fork server's answer to a fork, once it is up (milliseconds)
LIVENESS_S = 0.5  # how often an idle worker looks at its child
CHILD_MODULE = "kvboost_hf.server.grammar_child"


class CompileTimeout(KVBoostError, RuntimeError):
    """A compile ran past its time limit; its child process was killed."""


class CompileFailed(KVBoostError, RuntimeError):
    """The constraint could not be compiled (xgrammar's message), or the child died compiling it."""


class CompileDied(CompileFailed):
    """The child died (or its pipe broke) before answering; a new child is starting. The pool runs the job once
    more on another child before failing it with this."""


class _ChildExited(KVBoostError, OSError):
    """The child closed its answer pipe: it exited (internal; the caller restarts it and raises CompileDied)."""


class _Child(Protocol):
    """A compile child as :class:`CompileProcess` drives it: its pipes, liveness, kill and exit."""

    pid: int
    stdin: IO[bytes]
    stdout: IO[bytes]

    def running(self) -> bool: ...

    def kill(self) -> None: ...

    def wait(self, timeout_s: float) -> int | None:
        """Wait for the exit (subprocess.TimeoutExpired past ``timeout_s``); its status, None where unknown."""
        ...

    def close(self) -> None:
        """Close this side's pipes (and handles) of an exited child."""
        ...


class _SpawnedChild:
    """A child that is a fresh interpreter (``python -m kvboost_hf.server.grammar_child TOKENIZER_JSON_PATH``)."""

    def __init__(self, tokenizer_path: Path) -> None:
        self._popen = subprocess.Popen(
            [sys.executable, "-m", CHILD_MODULE, str(tokenizer_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=_child_environment(),
        )
        assert self._popen.stdin is not None and self._popen.stdout is not None
        self.pid, self.stdin, self.stdout = self._popen.pid, self._popen.stdin, self._popen.stdout

    def running(self) -> bool:
        return self._popen.poll() is None

    def kill(self) -> None:
        self._popen.kill()

    def wait(self, timeout_s: float) -> int | None:
        return self._popen.wait(timeout_s)

    def close(self) -> None:
        _close_quietly(self.stdin, self.stdout)


class _ForkedChild:
    """A child forked by the fork server: not this process's child, so it is watched and killed through a pidfd
    (race-free: the pid may be reused after its exit, the pidfd not), and its exit status is unknown (the kernel
    reaps it for the fork server)."""

    def __init__(self, pid: int, pidfd: int, stdin: IO[bytes], stdout: IO[bytes]) -> None:
        self.pid, self.stdin, self.stdout = pid, stdin, stdout
        self._pidfd = pidfd

    def running(self) -> bool:
        return not select.select([self._pidfd], [], [], 0)[0]

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):  # it has exited already
            signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    def wait(self, timeout_s: float) -> int | None:
        if not select.select([self._pidfd], [], [], timeout_s)[0]:
            raise subprocess.TimeoutExpired(f"grammar compile child {self.pid}", timeout_s)
        return None

    def close(self) -> None:
        _close_quietly(self.stdin, self.stdout)
        with contextlib.suppress(OSError):
            os.close(self._pidfd)


class _ForkServer:
    """The template the compile children are forked from (``python -m kvboost_hf.server.grammar_child --fork-server
    FD``: protocol in that module), driven over one socket; thread-safe (one fork at a time). It exits when its
    socket closes: at :meth:`close`, or when this process exits."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", CHILD_MODULE, "--fork-server", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=_child_environment(),
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.owner = os.getpid()  # a forked copy of this process must not share the socket
        self._control = ours
        self._lock = threading.Lock()
        self._ready = False

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def fork(self, tokenizer_path: Path) -> _ForkedChild:
        """A new compile child for the tokenizer at ``tokenizer_path`` (waits for the fork server's imports the
        first time). Raises OSError (or CompileTimeout) where the fork server is gone or stuck."""
        with self._lock:
            if not self._ready:
                if self._answer(CHILD_START_TIMEOUT_S) != b"ready":
                    raise _ChildExited("the grammar fork server did not start")
                self._ready = True
            job_read, job_write = os.pipe()
            answer_read, answer_write = os.pipe()
            try:
                socket.send_fds(self._control, [os.fsencode(tokenizer_path)], [job_read, answer_write])
                pid = int(self._answer(FORK_TIMEOUT_S))
                pidfd = os.pidfd_open(pid)  # ProcessLookupError if it already exited
            except BaseException:
                os.close(job_write)
                os.close(answer_read)
                raise
            finally:
                os.close(job_read)
                os.close(answer_write)
        return _ForkedChild(pid, pidfd, os.fdopen(job_write, "wb"), os.fdopen(answer_read, "rb"))

    def _answer(self, timeout_s: float) -> bytes:
        if not select.select([self._control], [], [], timeout_s)[0]:
            raise CompileTimeout(f"the grammar fork server did not answer within {timeout_s:g} s")
        message = self._control.recv(64)
        if not message:
            raise _ChildExited(f"the grammar fork server exited with status {self.process.wait(10)}")
        return message

    def close(self) -> None:
        """Stop it (its children live on until their pipes close or they are killed)."""
        self._control.close()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def fork_server_supported() -> bool:
    """Whether compile children can be forked from a fork server here: Linux 5.3+ (pidfds) with descriptor
    passing over Unix sockets."""
    if not (hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal") and hasattr(socket, "send_fds")):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:  # an older kernel
        return False
    return True


#: whether :func:`_launch` forks children from the fork server (else each is a fresh interpreter)
USE_FORK_SERVER = fork_server_supported()
_fork_server_lock = threading.Lock()
_fork_server: _ForkServer | None = None


def _launch(tokenizer_path: Path) -> _Child:
    """A new compile child for the tokenizer at ``tokenizer_path``: forked from this process's fork server (a new
    one if it is not running: killed from outside, or this process is a fork of its owner), else spawned."""
    if not USE_FORK_SERVER:
        return _SpawnedChild(tokenizer_path)
    try:
        return _current_fork_server().fork(tokenizer_path)
    except OSError as exc:  # the fork server died between two forks: once more, on a new one
        logger.warning("the grammar fork server failed (%s); starting another", exc)
        _stop_fork_server()
        return _current_fork_server().fork(tokenizer_path)


def _current_fork_server() -> _ForkServer:
    global _fork_server
    with _fork_server_lock:
        if _fork_server is None or _fork_server.owner != os.getpid() or not _fork_server.alive:
            if _fork_server is not None and _fork_server.owner == os.getpid():
                _fork_server.close()  # it died: its socket goes
            _fork_server = _ForkServer()
        return _fork_server


@atexit.register
def _stop_fork_server() -> None:
    """Close this process's fork server (at exit, or after it failed)."""
    global _fork_server
    with _fork_server_lock:
        server, _fork_server = _fork_server, None
    if server is not None and server.owner == os.getpid():
        server.close()


def _child_environment() -> dict[str, str]:
    """The children's environment: this process's, with this copy of kvboost_hf first on PYTHONPATH."""
    package_root = str(Path(__file__).resolve().parents[2])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (package_root, os.environ.get("PYTHONPATH"))))}


def _close_quietly(*streams: IO[bytes]) -> None:
    """Close ``streams``; a pipe whose reader died (closing flushes into it) is not an error."""
    for stream in streams:
        with contextlib.suppress(OSError):
            stream.close()


class CompileProcess:
    """One compile child for one tokenizer: ``info``, also written as xgrammar's JSON at ``tokenizer_path`` for the
    child to read (see the module for how children start). Jobs and answers are JSON lines on its stdin and stdout
    (:mod:`~kvboost_hf.server.grammar_child`). The child starts when first waited for (:meth:`wait_ready`) and after
    each restart. Used by one thread at a time."""

    def __init__(self, info: xgrammar.TokenizerInfo, tokenizer_path: Path) -> None:
        self.info, self.tokenizer_path = info, tokenizer_path
        self._closed = False
        self._child: _Child | None = None
        self._ready = False

    def compile(self, kind: str, args: list[Any], time_limit_s: float) -> xgrammar.CompiledGrammar:
        """The grammar of job ``kind`` with JSON ``args`` (see the child module), compiled in the child within
        ``time_limit_s`` seconds (CompileTimeout after: the child is killed and a new one started). Raises
        CompileFailed when it cannot compile."""
        try:
            child = self.wait_ready()
            child.stdin.write(json.dumps({"kind": kind, "args": args}).encode() + b"\n")
            child.stdin.flush()
            answer = self._receive(child, time_limit_s)
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
    def pid(self) -> int | None:
        """The current child's process id (None before it starts)."""
        return None if self._child is None else self._child.pid

    @property
    def alive(self) -> bool:
        """Whether the current child has not exited (it may have been killed while idle); True before it starts."""
        return self._child is None or self._child.running()

    def wait_ready(self) -> _Child:
        """The current child, started if needed, once it has answered its first line (at most
        CHILD_START_TIMEOUT_S)."""
        if self._closed:
            raise _ChildExited("the compile process is closed")
        child = self._child
        if child is None:
            child = self._child = _launch(self.tokenizer_path)
        if not self._ready:
            self._receive(child, CHILD_START_TIMEOUT_S)
            self._ready = True
        return child

    def _receive(self, child: _Child, timeout_s: float) -> dict[str, Any]:
        """``child``'s next answer line, its first byte within ``timeout_s``. ``child`` is the caller's: a
        :meth:`close` from another thread may have replaced ``self._child`` meanwhile."""
        readable, _, _ = select.select([child.stdout], [], [], timeout_s)
        if not readable:
            raise CompileTimeout(f"no answer within {timeout_s:g} s")
        line = child.stdout.readline()
        if not line:
            status = child.wait(10)
            raise _ChildExited("the child exited" + ("" if status is None else f" with status {status}"))
        answer: dict[str, Any] = json.loads(line)
        return answer

    def restart(self) -> None:
        """Replace the child by a new one (started when next waited for: see :meth:`wait_ready`)."""
        self._restart()

    def _restart(self) -> None:
        self._stop()
        self._ready = False

    def close(self) -> None:
        """Kill the child (a compile in flight fails) and start no other."""
        self._closed = True
        self._stop()

    def _stop(self) -> None:
        """Kill the child and close its pipes; a child already dead (its pipe broken) is not an error."""
        child, self._child = self._child, None
        if child is not None:
            child.kill()
            child.wait(10)
            child.close()


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
