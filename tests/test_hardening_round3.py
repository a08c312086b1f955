"""Issue #40 (hardening, third round): the disk tier's write lock is a lease that nobody holds forever, a flush
that says True means every chunk is on disk, and the smaller items. Every test runs real processes on
127.0.0.1 or a local directory and is bounded to a few seconds of waiting."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from forkserver import ForkedProcess
from helpers import (
    API_KEY,
    MODEL_NAME,
    LiveServer,
    assert_same,
    flip_inside_record,
    http_client,
    http_transport,
    key,
    python_child,
    raw_entry,
    run_python,
)

from kvboost_hf.server import grammar_process
from kvboost_hf.server.app import ServerConfig, create_app
from kvboost_hf.server.grammar import GrammarCompiler, GrammarConfig, GrammarError, GrammarQuota
from kvboost_hf.server.grammar_process import CompileDied, CompileProcess
from kvboost_hf.store import codec
from kvboost_hf.store.disk import MERGE_BATCH, WRITE_LOCK, DiskTier

# ---------------------------------------------------------------------------------------------- the write lock

_HOLD_LOCK = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from kvboost_hf.store.disk import _write_lock
    with _write_lock(Path(sys.argv[1]), 5.0, float(sys.argv[2])):
        print("held", flush=True)
        time.sleep(float(sys.argv[3]))
    print("released", flush=True)
    """
)


@pytest.fixture
def stopped_holder(tmp_path: Path) -> Iterator[Callable[[], ForkedProcess]]:
    """Starts a process holding ``WRITE_LOCK`` of ``tmp_path/d`` (where ``key(100)`` is stored) with a 0.5 s
    lease and stops it by SIGSTOP (a debugger, a hung process). A watchdog resumes it after 6 s, so code that
    waits for the lock without bound ends too (and fails its timing assertion) instead of hanging the suite."""
    directory = tmp_path / "d"
    tier = DiskTier(directory, 1 << 22)
    tier.put(key(100), raw_entry(seed=100))
    tier.close()
    started: list[ForkedProcess] = []
    watchdog = threading.Timer(6.0, lambda: [os.kill(p.pid, signal.SIGCONT) for p in started])

    def start() -> ForkedProcess:
        holder = python_child(_HOLD_LOCK, directory, "0.5", "1.0", stderr=None)
        started.append(holder)
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        os.kill(holder.pid, signal.SIGSTOP)
        watchdog.start()
        return holder

    try:
        yield start
    finally:
        watchdog.cancel()
        for holder in started:
            os.kill(holder.pid, signal.SIGCONT)
            holder.communicate(timeout=30)


def _put_batch(tier: DiskTier, first: int, count: int) -> None:
    for i in range(first, first + count):
        tier.put(key(i), raw_entry(seed=i))


def test_flush_returns_within_its_timeout_while_a_stopped_process_holds_the_lock(
    tmp_path: Path, stopped_holder: Callable[[], ForkedProcess], caplog
):
    """Before: ``flush(timeout_s=1)`` blocked until the holder ran again (here: the 6 s watchdog). Now it returns
    True within the timeout: the writes went to this process's spill (counted in ``lock_waits`` and
    ``spill_writes``) and are served from there, the holder is named once past its lease, and the spill is
    merged into the shared environment once it lets go."""
    directory = tmp_path / "d"
    tier = DiskTier(directory, 1 << 22, lock_wait_s=0.05, lease_s=5.0)
    holder = stopped_holder()
    try:
        with caplog.at_level("WARNING", logger="kvboost_hf.store.disk"):
            _put_batch(tier, 0, 8)
            time.sleep(0.6)  # the writer thread takes the batch; the holder passes its 0.5 s lease
            assert tier.get(key(100)) is not None  # a hit count for flush to commit
            start = time.monotonic()
            drained = tier.flush(timeout_s=1.0)
            elapsed = time.monotonic() - start
        assert elapsed < 1.0 + 0.5, elapsed
        assert drained
        assert tier.queued == 0 and all(tier.get(key(i)) is not None for i in range(8))  # served from the spill
        assert tier.stats()["lock_waits"] >= 1 and tier.stats()["spill_writes"] == 8
        assert tier.stats()["spilled"] == 8 and tier.stats()["chunks"] == 1
        assert f"held past its lease by process {holder.pid} (stopped" in caplog.text
        os.kill(holder.pid, signal.SIGCONT)
        assert holder.stdout is not None and holder.stdout.readline().strip() == "released"
        assert tier.flush(timeout_s=5.0)
        assert tier.stats()["spilled"] == 0 and tier.stats()["chunks"] == 9  # merged
    finally:
        tier.close()
    reopened = DiskTier(directory, 1 << 22)
    try:
        assert all(reopened.get(key(i)) is not None for i in range(8))
    finally:
        reopened.close()


def test_close_returns_within_its_timeout_while_a_stopped_process_holds_the_lock(
    tmp_path: Path, stopped_holder: Callable[[], ForkedProcess]
):
    """Before: ``close(timeout_s=1)`` took until the holder ran again, and dropped the 8 writes. Now within the
    timeout, nothing dropped: the writes are in this process's spill, served by a tier opened while the holder
    is still stopped."""
    tier = DiskTier(tmp_path / "d", 1 << 22, lock_wait_s=0.05)
    stopped_holder()
    _put_batch(tier, 0, 8)
    tier.note_tail(key(0), frozenset({3, 5}))
    start = time.monotonic()
    tier.close(timeout_s=1.0)
    assert time.monotonic() - start < 1.0 + 0.5
    assert tier.dropped == 0
    reopened = DiskTier(tmp_path / "d", 1 << 22, lock_wait_s=0.05)
    try:
        assert all(reopened.get(key(i)) is not None for i in range(8))
        assert reopened.tail_lengths(key(0)) == {3, 5}
    finally:
        reopened.close()


def test_a_damaged_spilled_record_is_a_miss(tmp_path: Path, stopped_holder: Callable[[], ForkedProcess]):
    """A spilled record is checked like any other (SHA-256 and the key it was stored under): a flipped byte in
    the spill's file is a miss, counted in ``corrupt``, never wrong K/V."""
    tier = DiskTier(tmp_path / "d", 1 << 22, lock_wait_s=0.05)
    stopped_holder()
    tier.put(key(7), raw_entry(seed=7))
    assert tier.flush(timeout_s=1.0) and tier.stats()["spill_writes"] == 1
    tier.close()
    (spill,) = [path for path in (tmp_path / "d" / "writers").iterdir() if not path.name.startswith(".")]
    flip_inside_record(spill, codec.encode(key(7), raw_entry(seed=7)), 3000)
    reopened = DiskTier(tmp_path / "d", 1 << 22, lock_wait_s=0.05)
    try:
        assert reopened.get(key(7)) is None
        assert reopened.stats()["corrupt"] == 1 and reopened.stats()["spilled"] == 0  # removed from its spill
    finally:
        reopened.close()


_STOP_MID_WRITE = textwrap.dedent(
    """
    import os, signal, sys
    from kvboost_hf.store.disk import DiskTier
    tier = DiskTier(sys.argv[1], 1 << 26)
    with tier._transaction():  # WRITE_LOCK and LMDB's own writer mutex held, a write transaction open
        print("writing", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    tier.close()
    """
)

_KEEP_WRITING = textwrap.dedent(
    """
    import json, sys, time
    from chunks import key, raw_entry
    from kvboost_hf.store.disk import DiskTier
    directory, process, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    tier = DiskTier(directory, 1 << 26)
    durable, flushes = [], []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        numbers = [process * 100_000 + len(flushes) * 4 + i for i in range(4)]
        for number in numbers:
            tier.put(key(number), raw_entry(seed=number))
        start = time.monotonic()
        if tier.flush(timeout_s=1.0):
            durable += numbers
        flushes.append(time.monotonic() - start)
    stats = tier.stats()
    start = time.monotonic()
    tier.close(timeout_s=1.0)
    close = time.monotonic() - start
    print(json.dumps({"durable": durable, "flushes": flushes, "close": close, "stats": stats}))
    """
)


def test_other_processes_keep_writing_while_one_is_stopped_mid_write(tmp_path: Path):
    """Item 5's target: three processes share a directory; one is stopped (SIGSTOP) inside a write transaction,
    holding ``WRITE_LOCK`` and LMDB's own writer mutex. Before: the other two wrote 0 chunks while it was stopped
    (every ``flush`` False after its timeout; LMDB allows one writer per environment). Now each writes into its
    own spill environment: its flushes return True within their timeout (+1 s), its close too, and after the
    stopped process resumes and all end, a reopened tier serves every chunk a flush called written (bit for bit)
    and merges the spills of the ended processes into the shared environment."""
    directory = tmp_path / "d"
    stopped = python_child(_STOP_MID_WRITE, directory, stderr=None)
    watchdog = threading.Timer(20.0, os.kill, (stopped.pid, signal.SIGCONT))  # never a hung suite
    try:
        assert stopped.stdout is not None and stopped.stdout.readline().strip() == "writing"
        watchdog.start()
        writers = [python_child(_KEEP_WRITING, directory, process, "1.0") for process in (1, 2)]
        reports = []
        for writer in writers:
            out, err = writer.communicate(timeout=60)
            assert writer.returncode == 0, err[-2000:]
            reports.append(json.loads(out))
        assert stopped.poll() is None  # still stopped: all of the above happened while it held the lock
    finally:
        watchdog.cancel()
        os.kill(stopped.pid, signal.SIGCONT)
        stopped.communicate(timeout=30)
    for report in reports:
        assert len(report["durable"]) >= 20, report["stats"]  # before: 0
        assert max(report["flushes"]) < 1.0 + 1.0 and report["close"] < 1.0 + 1.0
        assert report["stats"]["spill_writes"] >= len(report["durable"]) and report["stats"]["lost"] == 0
    durable = [number for report in reports for number in report["durable"]]
    reopened = DiskTier(directory, 1 << 26)
    try:
        for number in durable:
            found = reopened.get(key(number))
            assert found is not None, number
            assert_same(found, raw_entry(seed=number))
        for _ in range(len(durable) // MERGE_BATCH + 3):  # a slice per flush: the ended processes' spills
            assert reopened.flush(timeout_s=5.0)  # are adopted (merged), then removed
        assert reopened.stats()["spilled"] == 0 and reopened.stats()["chunks"] >= len(durable)
        assert [name for name in os.listdir(directory / "writers") if not name.startswith(".")] == []
    finally:
        reopened.close()


_DIE_AFTER_COMMIT = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    import lmdb
    from kvboost_hf.store.disk import _write_lock
    directory = Path(sys.argv[1])
    env = lmdb.open(str(directory), map_size=1 << 24, max_dbs=3, max_readers=1024)
    records = env.open_db(b"records")
    with _write_lock(directory, 5.0, 10.0):
        with env.begin(write=True, db=records) as txn:  # pages allocated and freed in one commit: never written
            txn.put(b"scratch", bytes(200_000))
            txn.delete(b"scratch")
        counted = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
        print("short" if os.stat(directory / "data.mdb").st_size < counted else "whole", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # dies between the commit and extending data.mdb
    """
)


def test_a_dead_holders_lock_is_taken_over_and_its_short_file_finished(tmp_path: Path, caplog):
    """A writer killed between its commit and extending ``data.mdb`` leaves the file shorter than its counted
    pages and its lease written. Before: the next reader called the file truncated and disabled the tier (and
    the next open set the whole file aside). Now the lease says its holder died: the file is extended, the entry
    is served, the takeover logged."""
    directory = tmp_path / "d"
    tier = DiskTier(directory, 1 << 22)
    try:
        tier.put(key(1), raw_entry(seed=1))
        assert tier.flush()
        result = run_python(_DIE_AFTER_COMMIT, str(directory))
        assert result.returncode == -signal.SIGKILL and result.stdout.strip() == "short", result.stderr[-2000:]
        with caplog.at_level("WARNING", logger="kvboost_hf.store.disk"):
            assert tier.get(key(1)) is not None
        assert tier.disabled is None
        assert "dead writer" in caplog.text
        tier.put(key(2), raw_entry(seed=2))
        assert tier.flush()
    finally:
        tier.close()
    assert (directory / WRITE_LOCK).read_text().strip() == ""  # released cleanly


# ---------------------------------------------------------------------------------------------- a full disk

_FILL = textwrap.dedent(
    """
    import json, sys
    from chunks import key, raw_entry
    from kvboost_hf.store.disk import DiskTier
    directory, process, batches = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    tier = DiskTier(directory, 1 << 30)
    durable, false_flushes = [], 0
    for batch in range(batches):
        keys = [key(process * 100_000 + batch * 4 + i) for i in range(4)]
        for i, k in enumerate(keys):
            tier.put(k, raw_entry(tokens=32, seed=batch * 4 + i))
        if tier.flush(timeout_s=10.0):
            durable += keys
        else:
            false_flushes += 1
    stats = tier.stats()
    tier.close()
    print(json.dumps({"durable": durable, "false_flushes": false_flushes, "lost": stats["lost"]}))
    """
)


@pytest.fixture
def small_file_system(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (needs root to mount; skipped otherwise)."""
    mount = tmp_path / "fs"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1024k", "tmpfs", str(mount)], capture_output=True)
    if mounted.returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_no_chunk_a_flush_called_written_is_missing_after_a_full_disk(small_file_system: Path):
    """Three processes fill one directory on a small file system, each flushing after every 4 chunks. Before:
    ``flush`` said True once the queue had drained, also when the batch's commit had failed with ENOSPC (only
    the first failure was a warning): whole batches of 4 missing after a reopen. Now every chunk of a flush
    that returned True reads back after the reopen, and the failures are counted in ``lost``."""
    directory = small_file_system / "d"
    processes = [python_child(_FILL, directory, process, "20") for process in range(3)]
    reports = []
    for process in processes:
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, err[-2000:]
        reports.append(json.loads(out))
    durable = [k for r in reports for k in r["durable"]]
    assert durable  # some batches landed before the disk filled up
    reopened = DiskTier(directory, 1 << 30)
    try:
        missing = [k for k in durable if reopened.get(k) is None]
    finally:
        reopened.close()
    assert missing == []
    assert sum(r["false_flushes"] for r in reports) > 0  # the disk did fill up
    assert sum(r["lost"] for r in reports) > 0  # and the chunks it refused are counted


# ---------------------------------------------------------------------------------------------- grammar compiles
_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from kvboost_hf.hf.models import embedded_model_dir

    return AutoTokenizer.from_pretrained(embedded_model_dir())


@pytest.fixture(scope="module")
def shared_compiler(tokenizer) -> Iterator[GrammarCompiler]:
    compiler = GrammarCompiler(tokenizer, len(tokenizer), GrammarConfig(workers=2, compile_limit_s=2.0))
    try:
        yield compiler
    finally:
        compiler.close()


@pytest.fixture
def compiler(shared_compiler: GrammarCompiler) -> GrammarCompiler:
    """Two compile workers (shared by the module's tests), every child up and answering before the test starts."""
    shared_compiler.wait_started()
    _wait_until_ready(shared_compiler)
    return shared_compiler


def _wait_until_ready(compiler: GrammarCompiler) -> None:
    """Until every worker's child (a new one after a kill) is up, 120 s at most."""
    deadline = time.monotonic() + 120
    while not all(p.ready and p.alive for p in compiler._pool._processes) and time.monotonic() < deadline:
        time.sleep(0.05)


def _children(compiler: GrammarCompiler) -> list[Any]:
    """The workers' current children (``_Child``: forked from the fork server, or spawned where it is missing)."""
    return [process._child for process in compiler._pool._processes if process._child is not None]


def test_a_child_killed_while_idle_costs_no_request(compiler: GrammarCompiler):
    """Before: the next requests got ``500 BrokenPipeError`` (from closing the dead child's stdin) and 400s. Now
    the compile that found its child dead runs again on the other worker's child, at once."""
    for child in _children(compiler):
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        start = time.monotonic()
        assert compiler.json_schema({**_SCHEMA, "title": str(child.pid)}).result(60) is not None
        assert time.monotonic() - start < 3.0  # no wait for the killed child's restart
        _wait_until_ready(compiler)  # the dead child's worker replaces it


def test_a_child_killed_mid_compile_is_retried_not_refused(compiler: GrammarCompiler, monkeypatch):
    """The OOM killer or an operator kills a child after the job was sent. Before: ``400 invalid_schema`` for a
    valid schema. Now the job runs again on another child."""
    original = CompileProcess._receive
    killed: list[int] = []

    def receive(process: CompileProcess, child, timeout_s: float):
        if process.ready and not killed:
            killed.append(child.pid)
            os.kill(child.pid, signal.SIGKILL)
        return original(process, child, timeout_s)

    monkeypatch.setattr(CompileProcess, "_receive", receive)
    assert compiler.json_schema(_SCHEMA).result(60) is not None
    assert len(killed) == 1


def test_children_killed_at_random_moments_cost_no_valid_schema(compiler: GrammarCompiler):
    """Valid schemas compile while a thread kills a random child twice at random moments: none is answered
    GrammarError (the client's 400) or anything else but its grammar."""
    import random

    chooser = random.Random(40)

    def killer() -> None:
        for _ in range(2):
            time.sleep(chooser.uniform(0.05, 0.5))
            live = [child for child in _children(compiler) if child.running()]
            if live:
                os.kill(chooser.choice(live).pid, signal.SIGKILL)

    thread = threading.Thread(target=killer)
    thread.start()
    futures = [compiler.json_schema({**_SCHEMA, "title": f"t{i}"}, client=f"c{i % 2}") for i in range(2)]
    for i in range(2, 12):
        futures[i - 2].result(120)
        futures.append(compiler.json_schema({**_SCHEMA, "title": f"t{i}"}, client=f"c{i % 2}"))
    thread.join()
    assert all(future.result(120) is not None for future in futures)


def _parent_pid(pid: int) -> int:
    """``pid``'s parent process id (Linux: /proc)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


@pytest.fixture
def tokenizer_info(tokenizer, tmp_path: Path) -> tuple[Any, Path]:
    """The embedded tokenizer's xgrammar info and its JSON file, as a pool writes them for its children."""
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    path = tmp_path / "tokenizer_info.json"
    path.write_text(info.serialize_json(), encoding="utf-8")
    return info, path


def _compiles(process: CompileProcess) -> bool:
    return process.compile("json_schema", [json.dumps(_SCHEMA)], 60) is not None


@pytest.mark.skipif(not grammar_process.USE_FORK_SERVER, reason="needs Linux 5.3+ (pidfds) for a fork server")
def test_compile_children_are_forks_of_one_fork_server_and_each_ends_with_its_pipe(tokenizer_info):
    """Every child (of every pool) is forked from this process's one fork server, so a restart imports nothing.
    A child holds no other child's pipes: closing one's stdin ends that child only."""
    first, second = (CompileProcess(*tokenizer_info) for _ in range(2))
    try:
        children = [first.wait_ready(), second.wait_ready()]
        server = grammar_process._fork_server
        assert server is not None and server.owner == os.getpid()
        assert {_parent_pid(child.pid) for child in children} == {server.process.pid}
        assert _compiles(first) and _compiles(second)
        children[0].stdin.close()
        children[0].wait(10)
        assert not first.alive and second.alive and _compiles(second)
        first.restart()  # replaced by another fork of the same server
        assert _parent_pid(first.wait_ready().pid) == server.process.pid and _compiles(first)
    finally:
        first.close()
        second.close()


@pytest.mark.skipif(not grammar_process.USE_FORK_SERVER, reason="needs Linux 5.3+ (pidfds) for a fork server")
def test_a_killed_fork_server_is_replaced_and_its_children_keep_compiling(tokenizer_info):
    """An operator (or the OOM killer) kills the fork server: children already forked go on compiling, and the
    next child comes from a new fork server."""
    running, later = (CompileProcess(*tokenizer_info) for _ in range(2))
    try:
        running.wait_ready()
        server = grammar_process._fork_server
        assert server is not None
        server.process.kill()
        server.process.wait(10)
        assert _compiles(running)
        replacement = _parent_pid(later.wait_ready().pid)
        assert replacement != server.process.pid and _compiles(later)
        assert grammar_process._fork_server is not None and grammar_process._fork_server.process.pid == replacement
    finally:
        running.close()
        later.close()


def test_a_close_while_a_worker_waits_for_its_child_fails_that_wait_cleanly(tokenizer_info, monkeypatch):
    """The server shuts down while a worker waits for its child's first line (the child stopped here, so the wait
    cannot end otherwise): the wait fails with the pool's OSError, which the worker handles, not an
    AttributeError from the child the close took away."""
    launch = grammar_process._launch

    def stopped(path: Path):
        child = launch(path)
        os.kill(child.pid, signal.SIGSTOP)
        return child

    monkeypatch.setattr(grammar_process, "_launch", stopped)
    process = CompileProcess(*tokenizer_info)
    failures: list[BaseException] = []

    def wait() -> None:
        try:
            process.wait_ready()
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.5)
    process.close()
    thread.join(30)
    assert not thread.is_alive() and len(failures) == 1 and isinstance(failures[0], OSError), failures


def test_without_a_fork_server_each_child_is_a_fresh_interpreter(tokenizer_info, monkeypatch):
    """Where a fork server is not supported (no pidfds: macOS, Linux before 5.3), each child is this process's
    own: killed, it is replaced by a new one."""
    monkeypatch.setattr(grammar_process, "USE_FORK_SERVER", False)
    process = CompileProcess(*tokenizer_info)
    try:
        child = process.wait_ready()
        assert _parent_pid(child.pid) == os.getpid() and _compiles(process)
        os.kill(child.pid, signal.SIGKILL)
        with pytest.raises(CompileDied):
            _compiles(process)
        assert _compiles(process) and process.pid != child.pid
    finally:
        process.close()


def test_one_client_holds_its_share_of_the_queue_whatever_its_salts(compiler: GrammarCompiler, monkeypatch):
    """Item 1's attack: one client keeps slow compiles waiting under a new ``cache_salt`` each. Before: the shared
    queue filled and every other client got GrammarBusy (503). Now the attacker gets GrammarQuota (429, naming
    the limit) past its share, and another client's compile is admitted and answered."""
    release = threading.Event()
    original = CompileProcess.compile

    def held(process, kind, args, time_limit_s):  # the attacker's compiles take as long as the test wants
        if "attack" in args[0]:
            assert release.wait(60)
        return original(process, kind, args, time_limit_s)

    monkeypatch.setattr(CompileProcess, "compile", held)
    share = compiler.limits.client_share
    assert share == 2
    try:
        attacks = [
            compiler.json_schema({**_SCHEMA, "title": f"attack {i}"}, tenant=f"salt-{i}", client="10.0.0.1")
            for i in range(share)
        ]
        with pytest.raises(GrammarQuota, match="its limit of 2 \\(max_waiting_per_client\\)"):
            compiler.json_schema({**_SCHEMA, "title": "attack more"}, tenant="salt-new", client="10.0.0.1")
        start = time.monotonic()
        assert compiler.json_schema(_SCHEMA, tenant="b", client="10.0.0.2").result(30) is not None
        assert time.monotonic() - start < 3.0  # a worker was left to it
    finally:
        release.set()
    assert all(attack.result(60) is not None for attack in attacks)
    assert compiler.json_schema({**_SCHEMA, "title": "attack again"}, client="10.0.0.1").result(60) is not None


def test_a_killed_compile_does_not_delay_the_next_request(compiler: GrammarCompiler):
    """Item 2: after a compile is killed at its time limit, the next compile goes to the idle worker instead of
    waiting for the killed child's restart (before: 4.5-5.8 s instead of 0.01 s)."""
    with pytest.raises(GrammarError, match="did not compile within"):
        compiler.json_schema({"type": "string", "pattern": "[a-z]{1,30000}"}).result(60)
    start = time.monotonic()
    assert compiler.json_schema(_SCHEMA).result(60) is not None
    assert time.monotonic() - start < 2.0


# ---------------------------------------------------------------------------------------------- connection cap
def test_health_and_metrics_are_served_over_the_connection_cap(embedded_engine):
    """A reverse proxy (one address) holding every connection the cap allows: before, its health probe got the
    429 too. Now ``/health`` and ``/metrics`` are answered (one request, then the connection closes) and any
    other path still gets the 429."""
    settings = ServerConfig(model_name=MODEL_NAME, api_key=API_KEY, header_timeout_s=20, max_connections_per_client=2)
    with LiveServer(create_app(embedded_engine, settings), settings=settings) as live:
        held = [socket.create_connection(("127.0.0.1", live.port), timeout=10) for _ in range(2)]
        try:
            time.sleep(0.2)  # the server counted them
            for path in ("/health", "/metrics"):
                reply = _raw_get(live.port, path)
                assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
            reply = _raw_get(live.port, "/v1/models")
            assert reply.startswith(b"HTTP/1.1 429") and b"too_many_connections" in reply, reply[:200]
        finally:
            for sock in held:
                sock.close()


def _raw_get(port: int, path: str) -> bytes:
    """Every byte of the reply to one GET on a fresh connection, read until the server closes it (10 s)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n\r\n".encode())
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


# ---------------------------------------------------------------------------------------------- damaged, read-only
def _fill(directory: Path, count: int) -> None:
    tier = DiskTier(directory, 1 << 24)
    for i in range(count):
        tier.put(key(i), raw_entry(tokens=2, seed=i))
    assert tier.flush()
    tier.close()


def test_a_damaged_branch_page_is_set_aside_at_the_next_open(tmp_path: Path, caplog):
    """The records database's root (a branch page over 400 entries) overwritten with zeros. Before: every read
    below it failed, in every process, until someone cleaned the directory by hand. Now the next open finds it,
    sets the file aside as ``data.mdb.damaged`` (counted, logged) and starts empty."""
    import struct

    import lmdb

    directory = tmp_path / "d"
    _fill(directory, 400)
    env = lmdb.open(str(directory), max_dbs=3, readonly=True, lock=False)
    with env.begin() as txn:
        raw = txn.get(b"records")  # the named database's record in the main one: md_depth at 6, md_root at 40
        depth, root = struct.unpack_from("<H", raw, 6)[0], struct.unpack_from("<Q", raw, 40)[0]
    page = env.stat()["psize"]
    env.close()
    assert depth >= 2  # the root is a branch page
    with open(directory / "data.mdb", "r+b") as data:
        data.seek(root * page)
        data.write(bytes(page))
    with caplog.at_level("WARNING", logger="kvboost_hf.store.disk"):
        tier = DiskTier(directory, 1 << 24)
    try:
        assert tier.disabled is None and tier.corrupt == 1
        assert (directory / "data.mdb.damaged").exists() and "damaged" in caplog.text
        tier.put(key(1), raw_entry(tokens=2, seed=1))
        assert tier.flush() and tier.get(key(1)) is not None
    finally:
        tier.close()


@pytest.fixture
def read_only_mount(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs with a filled cache directory ``d``, remounted read-only (needs root; skipped otherwise)."""
    mount = tmp_path / "ro"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        _fill(mount / "d", 20)
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_read_only_directory_is_served_read_only(read_only_mount: Path, caplog):
    """Before: the tier was disabled (every read a miss). Now its entries are served and nothing is written."""
    with caplog.at_level("WARNING", logger="kvboost_hf.store.disk"):
        tier = DiskTier(read_only_mount / "d", 1 << 24)
    try:
        assert tier.disabled is None and tier.read_only and tier.stats()["read_only"] == 1
        assert all(tier.get(key(i)) is not None for i in range(20))
        tier.put(key(99), raw_entry(tokens=2, seed=99))
        assert tier.flush() and tier.get(key(99)) is None and tier.errors == 0
        assert "read-only" in caplog.text
    finally:
        tier.close()


def test_a_client_over_its_compile_share_gets_a_429_and_others_are_answered(embedded_engine, monkeypatch):
    """Item 1 over HTTP: a client with its 2 compiles waiting (held here) asks for a third under a new salt: 429
    ``grammar_quota`` naming the limit (before: the shared queue's 503 for everyone). Another client address is
    answered meanwhile."""
    release = threading.Event()
    original = CompileProcess.compile

    def held(process, kind, args, time_limit_s):
        if "attack" in args[0]:
            assert release.wait(60)
        return original(process, kind, args, time_limit_s)

    monkeypatch.setattr(CompileProcess, "compile", held)
    admitted = threading.Semaphore(0)  # one release per attack compile the compiler took (queued or running)
    admit = GrammarCompiler._compile

    def counted(compiler, tenant, client, source, kind, args):
        future = admit(compiler, tenant, client, source, kind, args)
        if "attack" in source:
            admitted.release()
        return future

    monkeypatch.setattr(GrammarCompiler, "_compile", counted)
    settings = ServerConfig(model_name=MODEL_NAME, api_key=API_KEY, grammar_limits=GrammarConfig(workers=2))

    def body(title: str, salt: str) -> bytes:
        return _structured_body({**_SCHEMA, "title": title}, salt)

    headers = _HEADERS
    with LiveServer(create_app(embedded_engine, settings), settings=settings) as live:
        url = f"{live.url}/v1/chat/completions"
        with http_client(timeout=60) as attacker, ThreadPoolExecutor(2) as pool:
            held_requests = [
                pool.submit(attacker.post, url, content=body(f"attack {i}", f"s{i}"), headers=headers) for i in range(2)
            ]
            assert admitted.acquire(timeout=60) and admitted.acquire(timeout=60)  # both attacks hold their share
            third = attacker.post(url, content=body("third", "t"), headers=headers)
            assert third.status_code == 429, third.text
            assert third.json()["error"]["code"] == "grammar_quota" and "limit of 2" in third.text
            transport = http_transport(local_address="127.0.0.2")
            with http_client(timeout=60, transport=transport) as other:
                answered = other.post(url, content=body("other", "s"), headers=headers)
            assert answered.status_code == 200, answered.text
            release.set()
            assert all(request.result(60).status_code == 200 for request in held_requests)


def _structured_body(schema: dict, salt: str) -> bytes:
    """A chat request whose answer must follow ``schema``, under ``cache_salt`` ``salt``."""
    response_format = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    messages = [{"role": "user", "content": "Is water wet?"}]
    request = {"model": MODEL_NAME, "messages": messages, "max_tokens": 4, "temperature": 0}
    return json.dumps({**request, "response_format": response_format, "cache_salt": salt}).encode()


_HEADERS = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}


def test_an_invalid_schema_is_a_400_while_the_compile_queue_is_full(embedded_engine, monkeypatch):
    """Item 2's last clause: two clients hold the whole compile queue (2 places, compiles held here). A valid
    new schema from a third client gets 503 ``grammar_busy`` (the queue is full); invalid schemas, as a response
    format and as tool parameters, get 400 ``invalid_schema`` (before: 503, which clients retry)."""
    release = threading.Event()
    holding = threading.Semaphore(0)  # released once per held compile that started
    original = CompileProcess.compile

    def held(process, kind, args, time_limit_s):
        if "held" in json.dumps(args):
            holding.release()
            assert release.wait(60)
        return original(process, kind, args, time_limit_s)

    monkeypatch.setattr(CompileProcess, "compile", held)
    limits = GrammarConfig(workers=2, max_waiting=2, max_waiting_per_client=1)
    settings = ServerConfig(model_name=MODEL_NAME, api_key=API_KEY, grammar_limits=limits)
    with LiveServer(create_app(embedded_engine, settings), settings=settings) as live:
        url = f"{live.url}/v1/chat/completions"

        def post(address: str, content: bytes) -> httpx.Response:
            with http_client(timeout=60, transport=http_transport(local_address=address)) as client:
                return client.post(url, content=content, headers=_HEADERS)

        with ThreadPoolExecutor(2) as pool:
            holders = [
                pool.submit(post, f"127.0.0.{i + 1}", _structured_body({**_SCHEMA, "title": f"held {i}"}, "s"))
                for i in range(2)
            ]
            assert holding.acquire(timeout=60) and holding.acquire(timeout=60)  # both held compiles are running
            busy = post("127.0.0.3", _structured_body(_SCHEMA, "t"))
            assert busy.status_code == 503, busy.text
            assert busy.json()["error"]["code"] == "grammar_busy"
            invalid = post("127.0.0.3", _structured_body({"type": "object", "properties": {"a": {"type": "txt"}}}, "t"))
            assert invalid.status_code == 400, invalid.text
            assert invalid.json()["error"]["code"] == "invalid_schema" and "'txt'" in invalid.text
            tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "a"}}}
            request = json.loads(_structured_body(_SCHEMA, "t"))
            del request["response_format"]
            bad_tool = post("127.0.0.3", json.dumps({**request, "tools": [tool]}).encode())
            assert bad_tool.status_code == 400, bad_tool.text
            assert bad_tool.json()["error"]["code"] == "invalid_schema" and "tools[0]" in bad_tool.text
            release.set()
            assert all(holder.result(60).status_code == 200 for holder in holders)


def test_the_server_starts_its_compile_processes_when_it_starts(embedded_engine, monkeypatch):
    """``GrammarConfig.start_with_server`` (the default): the app's start starts the compile pool, before any
    request; with it off, nothing starts until a structured request comes."""
    from fastapi.testclient import TestClient

    from kvboost_hf.server.grammar_process import CompilePool

    started: list[CompilePool] = []
    start = CompilePool.start

    def recorded(pool: CompilePool) -> None:
        started.append(pool)
        start(pool)

    monkeypatch.setattr(CompilePool, "start", recorded)
    one_process = GrammarConfig(workers=1)  # the shipped start_with_server
    settings = ServerConfig(model_name=MODEL_NAME, api_key=API_KEY, grammar_limits=one_process)
    with TestClient(create_app(embedded_engine, settings)):
        assert len(started) == 1
    lazy = ServerConfig(model_name=MODEL_NAME, api_key=API_KEY, grammar_limits=GrammarConfig(start_with_server=False))
    with TestClient(create_app(embedded_engine, lazy)):
        assert len(started) == 1
