"""Redis Cluster: a 3-node cluster on loopback is one sharded tier shared by two stores."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from helpers import assert_same, free_port, make_entry

from kvboost_hf.store.chunk_store import ChunkStore
from kvboost_hf.store.config import StoreConfig


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[str]:
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if server is None or cli is None:
        pytest.skip("redis-server/redis-cli are not installed (.ci/start-redis.sh installs them)")
    ports = _cluster_ports(3)
    processes = []
    try:
        for port in ports:
            directory = tmp_path / str(port)
            directory.mkdir()
            args = [server, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes", "--save", ""]
            args += ["--appendonly", "no", "--dir", str(directory), "--cluster-config-file", "nodes.conf"]
            processes.append(subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for port in ports:
            _wait(lambda p=port: redis.Redis(port=p, socket_connect_timeout=0.2).ping())
        nodes = [f"127.0.0.1:{port}" for port in ports]
        create = [cli, "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"]
        subprocess.run(create, check=True, capture_output=True, timeout=60)
        for port in ports:
            _wait(lambda p=port: b"cluster_state:ok" in redis.Redis(port=p).execute_command("CLUSTER", "INFO"))
        yield f"redis+cluster://127.0.0.1:{ports[0]}"
    finally:
        for process in processes:
            process.terminate()
            process.wait(10)


def _cluster_ports(count: int) -> list[int]:
    """Free ports below 55535 whose cluster bus port (port + 10000) is free too."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port() % 20000 + 20000
        if port not in ports and all(_is_free(p) for p in (port, port + 10000)):
            ports.append(port)
    return ports


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _wait(ready, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if ready():
                return
        except redis.RedisError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("the Redis cluster did not come up")
        time.sleep(0.1)


def key(i: int) -> str:
    return f"{i:064x}"


def test_two_stores_share_a_sharded_cluster(cluster: str):
    entries = {i: make_entry(tokens=30, seed=i) for i in range(12)}
    writer = ChunkStore(StoreConfig(1 << 24, remote_url=cluster))
    reader = ChunkStore(StoreConfig(1 << 24, remote_url=cluster))
    try:
        assert writer.remote is not None and writer.remote.cluster
        for i, entry in entries.items():
            writer.put(key(i), entry)  # type: ignore[arg-type]
        writer.note_tail(key(0), 7)
        writer.flush()
        got = reader.get_many([key(i) for i in range(14)])
        assert [g is not None for g in got] == [True] * 12 + [False] * 2
        for i, entry in entries.items():
            assert_same(got[i], entry)  # type: ignore[arg-type]
        assert reader.tail_lengths(key(0)) == [7]
        assert reader.stats()["remote_hits"] == 12 and reader.stats()["remote_errors"] == 0
        masters = {port for port in _shard_ports(cluster) if redis.Redis(port=port).dbsize()}
        assert len(masters) == 3  # the chunks are spread over every shard
        reader.clear(remote=True)
        assert not any(redis.Redis(port=port).dbsize() for port in _shard_ports(cluster))
    finally:
        writer.close(timeout_s=2)
        reader.close(timeout_s=2)


def _shard_ports(cluster: str) -> list[int]:
    first = int(cluster.rsplit(":", 1)[1])
    lines = redis.Redis(port=first).execute_command("CLUSTER", "NODES").decode().splitlines()
    return [int(line.split()[1].split("@")[0].rsplit(":", 1)[1]) for line in lines]
