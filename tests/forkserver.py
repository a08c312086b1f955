"""Python subprocesses forked from one process that imported torch (and transformers) already (tests only).

A test that runs a ``python -m ...`` or ``python -c ...`` command in a subprocess pays ~8-10 s of CPU on this
suite's 2-core machine before the command does anything when the child imports torch and transformers' model code,
and ~1.9 s when it imports only the store (torch). :class:`ForkServer` imports them once and forks one process per
command, which then runs as ``python`` would run it (its argv, working folder, environment, stdout and stderr; the
exit status of ``SystemExit``, 1 with the traceback on stderr for an exception). :meth:`ForkServer.popen` returns a
:class:`ForkedProcess`, a ``subprocess.Popen`` stand-in for what tests and the code they drive use of one
(``wait``, ``poll``, ``communicate``, ``kill``, ``send_signal``, ``pid``, ``returncode``, ``stdout``, ``stderr``).

What a fork cannot give: environment variables read at import time are the fork server's (start it with the
environment its commands need), and nothing is imported fresh. Tests of import order or of a fresh interpreter
keep ``subprocess``.

Protocol: the test process sends each command (JSON: argv, cwd, env) with three file descriptors (the command's
stdout and stderr, and the write end of a status pipe) over a ``SOCK_SEQPACKET`` socket. The fork server forks a waiter
(reaped by the kernel: ``SIGCHLD`` ignored), which forks the command's process, writes its pid and then its exit
status (``subprocess``'s convention: ``-N`` for signal N) as lines on the status pipe. The fork server never
runs a command itself and never starts a thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

#: the fork server's program: the imports every command shares, then the loop of the module docstring
_SERVER = textwrap.dedent(
    """
    import atexit, importlib, json, os, runpy, signal, socket, sys, traceback
    for name in sys.argv[2].split(","):  # what every command would import itself
        importlib.import_module(name)

    def run(request, stdout, stderr):
        os.setpgid(0, 0)  # its own process group: a kill reaches what it starts
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.dup2(stdout, 1)
        os.dup2(stderr, 2)
        for fd in {stdout, stderr}:
            os.close(fd)
        argv = request["argv"]
        status = 0
        try:
            if argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            elif argv[0] == "-c":
                sys.argv = ["-c", *argv[2:]]
                exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
            else:
                raise ValueError(f"only -m and -c commands are forked: {argv[:2]}")
        except SystemExit as exit:
            code = exit.code
            if code is not None and not isinstance(code, int):
                print(code, file=sys.stderr)
            status = code if isinstance(code, int) else (0 if code is None else 1)
        except BaseException:
            traceback.print_exc()
            status = 1
        atexit._run_exitfuncs()  # as an interpreter's exit would
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(status)

    control = socket.socket(fileno=int(sys.argv[1]))
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the waiters are reaped by the kernel
    control.send(b"ready")
    while True:
        message, fds, _, _ = socket.recv_fds(control, 1 << 20, 3)
        if not message:
            break
        if os.fork() == 0:  # the waiter
            control.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            stdout, stderr, status = fds
            pid = os.fork()
            if pid == 0:
                os.close(status)
                run(json.loads(message), stdout, stderr)
            try:
                os.setpgid(pid, pid)  # as the command does itself: whichever runs first, a kill finds the group
            except OSError:
                pass
            os.close(stdout)
            os.close(stderr)
            os.write(status, f"{pid}\\n".encode())
            _, waited = os.waitpid(pid, 0)
            os.write(status, f"{os.waitstatus_to_exitcode(waited)}\\n".encode())
            os._exit(0)
        for fd in fds:
            os.close(fd)
    """
)


#: what :class:`ForkServer` imports by default: what a ``python -m kvboost_hf.bench ...`` step imports
MODEL_IMPORTS = ("torch", "transformers", "transformers.modeling_utils", "kvboost_hf")


class ForkedProcess:
    """A command forked by :class:`ForkServer`: ``subprocess.Popen``'s ``pid``, ``returncode``, ``poll``, ``wait``,
    ``communicate``, ``kill``, ``send_signal``, and ``stdout``/``stderr`` (file objects where ``PIPE`` was asked,
    else None)."""

    def __init__(self, argv: Sequence[str], status: IO[bytes], stdout: IO[Any] | None, stderr: IO[Any] | None) -> None:
        self.args = list(argv)
        self._status = status
        self.pid = int(status.readline())
        self.returncode: int | None = None
        self.stdout = stdout
        self.stderr = stderr
        self._readers: dict[str, threading.Thread] = {}
        self._read: dict[str, Any] = {}

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._status], [], [], 0)[0]:
            self._read_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._status], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._read_status()
        assert self.returncode is not None
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        """Read the piped outputs to their end and wait, as ``Popen.communicate`` (``TimeoutExpired`` after
        ``timeout`` seconds; a later call goes on where this one stopped)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for name in ("stdout", "stderr"):
            stream = getattr(self, name)
            if stream is not None and name not in self._readers:
                self._readers[name] = threading.Thread(target=self._drain, args=(name, stream), daemon=True)
                self._readers[name].start()
        for reader in self._readers.values():
            reader.join(None if deadline is None else max(deadline - time.monotonic(), 0.0))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        self.wait(None if deadline is None else max(deadline - time.monotonic(), 0.0))
        return self._read.get("stdout"), self._read.get("stderr")

    def _drain(self, name: str, stream: IO[Any]) -> None:
        """Read ``stream`` to its end into ``_read[name]``, then close it (as ``Popen.communicate`` does)."""
        with stream:
            self._read[name] = stream.read()

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # it exited already
                os.kill(self.pid, signum)

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # it exited already
                os.killpg(self.pid, signal.SIGKILL)

    def _read_status(self) -> None:
        line = self._status.readline()
        self.returncode = int(line) if line.strip() else -signal.SIGKILL  # the waiter itself was killed
        self._status.close()


class ForkServer:
    """One fork server (see the module), started with ``env`` after importing ``imports``; ``close`` (or the
    context manager) stops it. Thread-safe: each :meth:`popen` sends one message and gets its answers on a pipe of
    its own."""

    def __init__(self, env: dict[str, str], imports: Sequence[str] = MODEL_IMPORTS) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.process = subprocess.Popen(
            [sys.executable, "-c", _SERVER, str(theirs.fileno()), ",".join(imports)],
            pass_fds=(theirs.fileno(),),
            env=env,
        )
        theirs.close()
        self._control = ours
        if not select.select([ours], [], [], 300)[0] or ours.recv(16) != b"ready":
            self.close()
            raise RuntimeError("the test fork server did not start")

    def popen(
        self,
        argv: Sequence[str],
        *,
        stdout: IO[Any] | int | None = None,
        stderr: IO[Any] | int | None = None,
        cwd: str | Path | None = None,
        env: dict[str, str] | None = None,
        text: bool = False,
    ) -> ForkedProcess:
        """Run ``python *argv`` (``-m module ...`` or ``-c code ...``) in ``cwd`` (default: this process's) with
        ``env`` (default: this process's). ``stdout`` and ``stderr`` as ``subprocess.Popen`` takes them: a file, a
        descriptor, ``subprocess.PIPE``, ``subprocess.STDOUT`` (stderr only) or None (this process's); ``text``:
        the pipes read as text."""
        opened: list[int] = []  # the child's ends, closed here once sent
        piped: dict[str, IO[Any]] = {}

        def descriptor(name: str, target: IO[Any] | int | None, default: int) -> int:
            if target is None:
                return default
            if target == subprocess.PIPE:
                read, write = os.pipe()
                opened.append(write)
                piped[name] = os.fdopen(read, "r" if text else "rb")
                return write
            return target if isinstance(target, int) else target.fileno()

        out = descriptor("stdout", stdout, 1)
        err = out if stderr == subprocess.STDOUT else descriptor("stderr", stderr, 2)
        status_read, status_write = os.pipe()
        opened.append(status_write)
        try:
            request = json.dumps({"argv": list(argv), "cwd": str(cwd or os.getcwd()), "env": env or dict(os.environ)})
            socket.send_fds(self._control, [request.encode()], [out, err, status_write])
        except BaseException:
            os.close(status_read)
            for stream in piped.values():
                stream.close()
            raise
        finally:
            for fd in opened:
                os.close(fd)
        return ForkedProcess(argv, os.fdopen(status_read, "rb"), piped.get("stdout"), piped.get("stderr"))

    def close(self) -> None:
        self._control.close()  # its loop ends with the socket
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
