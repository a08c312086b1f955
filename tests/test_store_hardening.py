"""Issue #22, store items: in-place weight changes, damaged or swapped LMDB files, stats on damaged tiers,
Redis connect hangs, restarts, foreign HMAC secrets and wrong-type keys. No case may kill the process or serve
K/V computed from other weights."""

from __future__ import annotations

import shutil
import socket
import subprocess
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from conftest import greedy, make_tiny_model
from helpers import RedisServer, key, make_entry, python_child, raw_entry, run_python

from kvboost_hf import ChunkReuseCache
from kvboost_hf.core.chunk_kv import ChunkKV
from kvboost_hf.core.keys import model_digest
from kvboost_hf.store.chunk_store import ChunkStore
from kvboost_hf.store.config import StoreConfig
from kvboost_hf.store.remote import RemoteTier

# ---------------------------------------------------------------------------------------------- model digest

_EDITS: dict[str, Callable[[torch.nn.Module], None]] = {
    "optimizer_step": lambda m: _optimizer_step(m),
    "load_state_dict": lambda m: m.load_state_dict({k: v + 0.01 for k, v in m.state_dict().items()}),
    "merged_adapter": lambda m: _merge_low_rank(m.model.layers[0].self_attn.q_proj),
    "data_replaced": lambda m: setattr(m.model.norm.weight, "data", m.model.norm.weight.detach() * 1.5),
}


def _optimizer_step(model: torch.nn.Module) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.tensor([[1, 2, 3, 4]])).logits.sum().backward()
    optimizer.step()


def _merge_low_rank(linear: torch.nn.Linear) -> None:
    """What PEFT's ``merge_and_unload`` does to a base weight: W += B @ A, in place."""
    out_features, in_features = linear.weight.shape
    a = torch.randn(4, in_features, generator=torch.Generator().manual_seed(0))
    b = torch.randn(out_features, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        linear.weight += 0.05 * (b @ a)


@pytest.mark.parametrize("edit", list(_EDITS))
def test_in_place_weight_change_changes_the_digest(edit: str):
    model = make_tiny_model("llama")
    before = model_digest(model)
    _EDITS[edit](model)
    assert model_digest(model) != before


def test_writes_through_param_data_are_not_seen_until_forgotten():
    """The documented limit: ``param.data`` is an alias with its own version counter."""
    from kvboost_hf.core.keys import forget_model_digest

    model = make_tiny_model("llama")
    before = model_digest(model)
    model.model.norm.weight.data.mul_(2)
    assert model_digest(model) == before
    forget_model_digest(model)
    assert model_digest(model) != before


@pytest.mark.parametrize("edit", ["optimizer_step", "load_state_dict", "merged_adapter"])
def test_generation_after_an_in_place_change_reuses_nothing_stale(edit: str):
    """Generate, change the weights in place, generate with a new cache on the same store: the output is the
    new weights' plain output (before the fix, 12 tokens were reused from the old weights)."""
    model = make_tiny_model("llama")
    ids = torch.randint(1, 128, (1, 28), generator=torch.Generator().manual_seed(3))
    store = ChunkStore(StoreConfig(1 << 24))
    greedy(model, ids, ChunkReuseCache(store, model, chunking=4), new=2)
    _EDITS[edit](model)
    model.zero_grad(set_to_none=True)
    _, plain = greedy(model, ids, new=2)
    hits_before = store.stats()["hits"]
    _, reused = greedy(model, ids, ChunkReuseCache(store, model, chunking=4), new=2)
    assert store.stats()["hits"] == hits_before
    torch.testing.assert_close(reused, plain, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------- LMDB files

_DISK_SCENARIO = textwrap.dedent(
    """
    import os, sys
    from chunks import key, raw_entry
    from kvboost_hf.store.disk import DiskTier

    args = sys.argv[1:]
    for index, (directory, damage) in enumerate(zip(args[::2], args[1::2])):  # one case per directory
        tier = DiskTier(directory, 1 << 22)
        tier.put(key(1), raw_entry())
        tier.flush()
        if damage.startswith("truncate:"):
            os.truncate(os.path.join(directory, "data.mdb"), int(damage.split(":")[1]))
        print(index, "get", tier.get(key(1)) is not None, "disabled", tier.disabled is not None, flush=True)
        tier.put(key(2), raw_entry(seed=2))
        tier.flush()
        print(index, "held", tier.get(key(2)) is not None, flush=True)
    """
)


TRUNCATED_SIZES = [100, 4096, 8192 + 100]


@pytest.fixture(scope="module")
def truncated_runs(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """The disk scenario with data.mdb truncated under an open tier to each of :data:`TRUNCATED_SIZES` (case i in
    directory ``d{i}``), then a new process opening each directory undamaged: two interpreters for the three cases
    (starting one costs seconds of imports)."""
    root = tmp_path_factory.mktemp("truncated")
    cases = [(str(root / f"d{i}"), f"truncate:{size}") for i, size in enumerate(TRUNCATED_SIZES)]
    damaged = run_python(_DISK_SCENARIO, *(arg for case in cases for arg in case), timeout=120)
    reopened = run_python(_DISK_SCENARIO, *(arg for directory, _ in cases for arg in (directory, "none")), timeout=120)
    return root, damaged, reopened


@pytest.mark.parametrize("size", TRUNCATED_SIZES)
def test_data_file_truncated_under_an_open_tier_is_a_miss_not_sigbus(truncated_runs, size: int):
    """Truncated below its meta pages (100, 4096 bytes) or below its used pages: a warning and misses; a tier
    opened afterwards sets the file aside and starts empty. Before: SIGBUS reading ``env.info()``."""
    root, damaged, reopened = truncated_runs
    case = TRUNCATED_SIZES.index(size)
    assert damaged.returncode == 0, damaged.stderr[-2000:]
    assert f"{case} get False disabled True" in damaged.stdout
    assert reopened.returncode == 0, reopened.stderr[-2000:]  # a new process: the file is set aside
    assert f"{case} get True disabled False\n{case} held True" in reopened.stdout
    assert (root / f"d{case}" / "data.mdb.damaged").exists()


_HOLD_OPEN = textwrap.dedent(
    """
    import sys, time
    import lmdb
    env = lmdb.open(sys.argv[1], map_size=1 << 22, max_dbs=3, max_readers=1024)
    print("open", flush=True)
    time.sleep(60)
    """
)


@pytest.mark.parametrize("offset", [0, 8])
def test_garbage_in_the_lock_file_disables_the_tier(tmp_path: Path, offset: int):
    """Garbage over the lock file's header while another process holds it (so LMDB does not rebuild it): the
    tier is disabled with a warning. Before: MDB_INVALID (offset 0) or a process hung in a garbage mutex."""
    from kvboost_hf.store.disk import DiskTier

    directory = tmp_path / "d"
    tier = DiskTier(directory, 1 << 22)  # the files, created here and closed before another process holds them
    tier.put(key(1), raw_entry())
    assert tier.flush()
    tier.close()
    holder = python_child(_HOLD_OPEN, directory, stderr=None)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        garbage = bytes(range(256)) * 32
        run_python(f"f = open({str(directory / 'lock.mdb')!r}, 'r+b'); f.seek({offset}); f.write({garbage!r})")
        result = run_python(_DISK_SCENARIO, str(directory), "none", timeout=30)
    finally:
        holder.kill()
        holder.wait()
    assert result.returncode == 0, result.stderr[-2000:]
    assert "0 get False disabled True" in result.stdout
    assert "lock.mdb" in result.stderr  # the warning names the file


def test_no_room_for_the_lock_file_disables_the_tier(tmp_path: Path, monkeypatch, caplog):
    """What a full file system does to the lock file's allocation (simulated): the tier is disabled."""
    import errno

    from kvboost_hf.store import disk

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk.os, "posix_fallocate", full)
    with caplog.at_level("WARNING", logger="kvboost_hf.store.disk"):
        tier = disk.DiskTier(tmp_path / "d", 1 << 22)
    assert tier.disabled is not None and "file system full" in tier.disabled
    assert tier.get(key(1)) is None
    tier.close()


def test_full_file_system_is_a_warning_not_sigbus(tmp_path: Path):
    """A real full file system: a 256 KiB tmpfs filled up (needs root to mount; skipped otherwise). Before:
    SIGBUS when LMDB first wrote to its lock file's map."""
    mount = tmp_path / "fs"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        subprocess.run(["dd", "if=/dev/zero", f"of={mount / 'fill'}", "bs=4k", "count=100"], capture_output=True)
        result = run_python(_DISK_SCENARIO, str(mount / "d"), "none")
    finally:
        subprocess.run(["umount", str(mount)], check=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "get False disabled True" in result.stdout


def test_directory_recreated_by_another_process_is_noticed(tmp_path: Path, caplog):
    """The directory deleted and created again (another process opened a new environment there): writes would
    go to the unlinked file. Before: 100/100 flushed entries lost with no error counted."""
    directory = tmp_path / "d"
    store = ChunkStore(StoreConfig(1 << 24, disk_cache_dir=directory))
    store.put(key(0), raw_entry())
    store.flush()
    shutil.rmtree(directory)
    assert run_python("import sys, lmdb; lmdb.open(sys.argv[1], max_dbs=3).close()", str(directory)).returncode == 0
    with caplog.at_level("WARNING", logger="kvboost_hf.store.disk"):
        for i in range(1, 101):
            store.put(key(i), raw_entry(seed=i))
        store.flush()
    stats = store.stats()
    assert stats["disk_disabled"] == 1 and stats["disk_errors"] >= 1
    assert "deleted or replaced" in caplog.text
    store.close()


# ---------------------------------------------------------------------------------------------- Redis


@pytest.fixture
def unaccepting_port() -> Iterator[int]:
    """A loopback port whose accept queue is full: a new connection hangs in connect (SYNs are dropped)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = int(server.getsockname()[1])
    fillers = []
    for _ in range(4):  # the queue holds backlog + 1 connections; the rest stay unanswered
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
        fillers.append(filler)
    time.sleep(0.1)
    yield port
    for s in [*fillers, server]:
        s.close()


def test_hung_connect_is_bounded_by_the_read_timeout(unaccepting_port: int):
    """Before: a lookup waited for the writer's connect timeout (here 2 s) instead of ``read_timeout_s``."""
    tier = RemoteTier(f"redis://127.0.0.1:{unaccepting_port}/0", timeout_s=2.0, read_timeout_s=0.1, retry_after_s=0)
    try:
        started = time.monotonic()
        assert tier.get_many([key(1), key(2)]) == [None, None]
        assert time.monotonic() - started < 1.0
        assert tier.errors >= 1
    finally:
        tier.close(timeout_s=1)


def test_tail_notes_are_published_again_after_a_redis_restart(redis_server: RedisServer):
    store = ChunkStore(StoreConfig(1 << 24, remote_url=redis_server.url))
    assert store.remote is not None
    try:
        for i in range(18):
            store.note_tail(key(i), 5 + i)
        store.flush()
        admin = redis_server.client()
        assert len(admin.keys(store.remote.prefix + "tail:*")) == 18
        redis_server.stop()
        redis_server.start()  # empty
        assert store.remote.check_restart()
        store.flush()
        assert len(redis_server.client().keys(store.remote.prefix + "tail:*")) == 18
        assert store.remote.tail_lengths(key(3)) == {8}
    finally:
        store.close(timeout_s=2)


def test_a_replica_with_another_secret_refuses_without_deleting(redis_server: RedisServer):
    mine = RemoteTier(redis_server.url, hmac_key="mine")
    theirs = RemoteTier(redis_server.url, hmac_key="theirs")
    try:
        for i in range(5):
            mine.put(key(i), make_entry(seed=i))
        assert mine.flush(5)
        assert theirs.get_many([key(i) for i in range(5)]) == [None] * 5 and theirs.corrupt == 5
        assert all(mine.get_many([key(i) for i in range(5)]))
        assert redis_server.client().exists(*[mine.prefix + key(i) for i in range(5)]) == 5
    finally:
        mine.close(timeout_s=2)
        theirs.close(timeout_s=2)


def test_a_replica_without_a_secret_refuses_sealed_records_without_deleting(redis_server: RedisServer):
    """A replica with no HMAC key cannot read a sealed record: a miss, counted, and left for the replicas that
    hold the key (it used to be decoded as a damaged record and deleted)."""
    sealed = RemoteTier(redis_server.url, hmac_key="mine")
    keyless = RemoteTier(redis_server.url)
    try:
        for i in range(5):
            sealed.put(key(i), make_entry(seed=i))
        assert sealed.flush(5)
        assert keyless.get_many([key(i) for i in range(5)]) == [None] * 5 and keyless.corrupt == 5
        assert keyless.flush(5) and redis_server.client().exists(*[sealed.prefix + key(i) for i in range(5)]) == 5
        assert all(sealed.get_many([key(i) for i in range(5)]))
    finally:
        sealed.close(timeout_s=2)
        keyless.close(timeout_s=2)


def test_wrong_type_tail_key_is_removed(remote: RemoteTier, redis_server: RedisServer):
    admin = redis_server.client()
    admin.set(remote.prefix + "tail:" + key(1), b"not a set")
    assert remote.tail_lengths(key(1)) == set() and remote.corrupt == 1
    assert not admin.exists(remote.prefix + "tail:" + key(1))
    remote.note_tail(key(1), frozenset({7}))
    assert remote.flush(5) and remote.tail_lengths(key(1)) == {7}


@pytest.mark.parametrize("wrong", ["tokens", "layers", "heads", "head_dim"])
def test_a_stored_record_of_the_wrong_shape_is_a_miss_not_a_failed_request(wrong: str, caplog):
    """A record under a prompt's real prefix key whose K/V do not fit the model (another replica's bug, a
    hand-written record) is skipped with a warning; the generation equals plain generate()."""
    model = make_tiny_model("llama", seed=3)
    store = ChunkStore()
    ids = torch.randint(1, 120, (1, 20), generator=torch.Generator().manual_seed(4))
    cold = ChunkReuseCache(store, model, 8)
    greedy(model, ids, cold)  # stores the prompt's chunks: take the first one's key and shape
    first_key = cold.ledgers[0].keys[0]
    layers, heads, tokens, dim = store.get(first_key).keys.shape
    shape = {
        "tokens": (layers, heads, tokens - 1, dim),
        "layers": (layers + 1, heads, tokens, dim),
        "heads": (layers, heads + 1, tokens, dim),
        "head_dim": (layers, heads, tokens, dim * 2),
    }[wrong]
    store.clear()
    store.put(first_key, ChunkKV(torch.zeros(shape), torch.zeros(shape)))
    warm = ChunkReuseCache(store, model, 8)
    with caplog.at_level("WARNING"):
        out, _ = greedy(model, ids, warm)
    plain, _ = greedy(model, ids)
    assert torch.equal(out, plain) and warm.last_reuse[0].cached_tokens == 0
    assert "treated as a miss" in caplog.text
