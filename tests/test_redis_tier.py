"""Redis tier against a private redis-server: round trips, sharing between processes, outages, damage."""

from __future__ import annotations

import json
import logging
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from helpers import RedisServer, assert_same, generate_through_store, key, make_entry, run_python

from kvboost_hf.core.chunk_kv import ChunkKV
from kvboost_hf.store import codec
from kvboost_hf.store.remote import RemoteTier


@pytest.mark.parametrize("bits", [16, 8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_through_redis(remote: RemoteTier, redis_server: RedisServer, bits: int, dtype: torch.dtype):
    entry = make_entry(tokens=33, bits=bits, dtype=dtype)
    assert remote.put(key(1), entry) == []
    assert remote.flush(5)
    raw = redis_server.client().get("kvboost:" + key(1))
    assert raw is not None and raw[:4] == codec.MAGIC and remote.nbytes == len(raw) and len(remote) == 1
    reader = RemoteTier(redis_server.url)  # another client, as another replica would be
    try:
        got = reader.get(key(1))
        assert got is not None
        assert_same(got, entry)
        assert reader.contains(key(1)) and not reader.contains(key(2))
    finally:
        reader.close()


def test_prefix_and_key_isolation(remote: RemoteTier, redis_server: RedisServer):
    """Another prefix sees nothing; a record copied under another key (another namespace) is refused."""
    remote.put(key(1), make_entry())
    assert remote.flush(5)
    other = RemoteTier(redis_server.url, prefix="tenant-b:")
    try:
        assert other.get(key(1)) is None
        other.put(key(1), make_entry(seed=9))
        assert other.flush(5)
        got_a, got_b = remote.get(key(1)), other.get(key(1))
        assert got_a is not None and got_b is not None
        assert_same(got_a, make_entry())
        assert_same(got_b, make_entry(seed=9))
        other.clear()
        assert remote.get(key(1)) is not None and other.get(key(1)) is None
    finally:
        other.close()
    client = redis_server.client()
    client.set("kvboost:" + key(2), client.get("kvboost:" + key(1)))
    assert remote.get(key(2)) is None
    assert remote.corrupt == 1 and client.exists("kvboost:" + key(2)) == 0


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_corrupted_values_are_misses(remote: RemoteTier, redis_server: RedisServer, damage: str, caplog):
    remote.put(key(1), make_entry())
    assert remote.flush(5)
    client = redis_server.client()
    raw = bytearray(client.get("kvboost:" + key(1)))
    if damage == "flip":
        raw[len(raw) // 2] ^= 1
    elif damage == "truncate":
        raw = raw[: len(raw) - 7]
    else:
        raw = bytearray(b"\x80\x04K\x01.")  # a pickle: never unpickled, just refused
    client.set("kvboost:" + key(1), bytes(raw))
    with caplog.at_level(logging.WARNING, logger="kvboost_hf.store.remote"):
        assert remote.get(key(1)) is None
    assert remote.corrupt == 1 and "corrupt" in caplog.text
    assert client.exists("kvboost:" + key(1)) == 0  # dropped, so the next writer recomputes it


def test_outage_degrades_to_misses(remote: RemoteTier, redis_server: RedisServer, caplog):
    remote.put(key(1), make_entry())
    assert remote.flush(5)
    redis_server.stop()
    with caplog.at_level(logging.WARNING, logger="kvboost_hf.store.remote"):
        started = time.monotonic()
        for _ in range(20):
            assert remote.get(key(1)) is None
            assert not remote.contains(key(1))
            remote.put(key(2), make_entry(seed=2))
            remote.delete(key(1))
        remote.clear()
        assert time.monotonic() - started < 5  # back-off: no timeout paid on every call
    assert remote.errors >= 1 and remote.dropped >= 1
    assert caplog.text.count("unavailable") == 1
    redis_server.start()  # an empty server on the same port: the tier recovers by itself
    time.sleep(0.3)
    remote.put(key(3), make_entry(seed=3))
    assert remote.flush(5)
    got = remote.get(key(3))
    assert got is not None
    assert_same(got, make_entry(seed=3))


def test_full_queue_drops_writes_without_waiting(redis_server: RedisServer):
    tier = RemoteTier(redis_server.url, queue_size=2, timeout_s=3)
    admin = redis_server.client()
    try:
        admin.execute_command("CLIENT", "PAUSE", "1500", "WRITE")  # the writer's first SET blocks
        tier.put(key(0), make_entry())
        deadline = time.monotonic() + 5
        while tier.waiting and time.monotonic() < deadline:
            time.sleep(0.01)
        started = time.monotonic()
        for i in range(1, 6):
            tier.put(key(i), make_entry(seed=i))
        assert time.monotonic() - started < 0.5
        assert tier.dropped == 3
        assert tier.flush(10)
        assert tier.written == 3
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
        tier.close()


def test_second_process_reuses_first_process_chunks(redis_server: RedisServer):
    """The test process writes a prompt's chunks to Redis; a new process finds them there (its own import, its own
    store) and generates the tokens of a full prefill."""
    first = json.loads(json.dumps(generate_through_store(redis_server.url)))
    child = run_python(
        "import json, sys\nfrom helpers import generate_through_store\n"
        "print(json.dumps(generate_through_store(sys.argv[1])))",
        redis_server.url,
    )
    assert child.returncode == 0, child.stderr
    second = json.loads(child.stdout.strip().splitlines()[-1])
    assert first["cached_tokens"] == 0 and first["stats"]["remote_bytes"] > 0
    assert second["cached_tokens"] == 64 and second["stats"]["remote_hits"] == 4
    assert second["tokens"] == second["full_prefill"] == first["tokens"]


def test_redis_budget_is_enforced_by_redis(remote: RemoteTier, redis_server: RedisServer):
    """With ``maxmemory`` and ``allkeys-lru`` Redis evicts old chunks; they become plain misses."""
    admin = redis_server.client()
    admin.config_set("maxmemory", str(4 << 20))
    entries = [make_entry(tokens=2000, seed=i) for i in range(12)]  # ~770 KB records, ~9 MB in all
    for i, entry in enumerate(entries):
        remote.put(key(i), entry)
        assert remote.flush(5)
    assert int(admin.info("memory")["used_memory"]) <= 5 << 20
    served = [remote.get(key(i)) for i in range(len(entries))]
    assert served[0] is None and served[-1] is not None
    for got, entry in zip(served, entries, strict=True):
        if got is not None:
            assert_same(got, entry)
    assert remote.errors == 0 and remote.corrupt == 0


def test_error_reply_fails_one_write_without_an_outage(remote: RemoteTier, redis_server: RedisServer):
    """A value Redis refuses (OOM under a tiny ``maxmemory``) is one counted error, not a back-off."""
    redis_server.client().config_set("maxmemory", "1")  # every write is now refused with an OOM reply
    remote.put(key(1), make_entry())
    assert remote.flush(5)
    assert remote.errors == 1 and remote.dropped == 1
    redis_server.client().config_set("maxmemory", "0")
    remote.put(key(2), make_entry(seed=2))
    assert remote.flush(5)
    assert remote.get(key(2)) is not None


def test_auth_comes_from_the_url(tmp_path: Path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (.ci/start-redis.sh installs it)")
    server = RedisServer(tmp_path, password="s3cret")
    server.start()
    tier = RemoteTier(server.url)
    intruder = RemoteTier(server.url.replace("s3cret", "wrong"))
    try:
        tier.put(key(1), make_entry())
        assert tier.flush(5)
        got = tier.get(key(1))
        assert got is not None
        assert_same(got, make_entry())
        assert intruder.get(key(1)) is None and intruder.errors == 1  # refused, as a miss
    finally:
        intruder.close(timeout_s=1)
        tier.close(timeout_s=1)
        server.stop()


def test_get_many_is_one_round_trip_and_keeps_order(remote: RemoteTier, redis_server: RedisServer):
    entries = {i: make_entry(seed=i) for i in range(0, 10, 2)}
    for i, entry in entries.items():
        remote.put(key(i), entry)
    assert remote.flush(5)
    admin = redis_server.client()
    admin.config_resetstat()
    got = remote.get_many([key(i) for i in range(10)])
    for i, stored in enumerate(got):
        if i in entries:
            assert stored is not None
            assert_same(stored, entries[i])
        else:
            assert stored is None
    assert int(admin.info("commandstats")["cmdstat_get"]["calls"]) == 10
    assert remote.contains_many([key(0), key(1)]) == [True, False]


def test_wrong_type_key_is_deleted_like_a_corrupt_record(remote: RemoteTier, redis_server: RedisServer):
    admin = redis_server.client()
    admin.rpush(remote.prefix + key(1), b"not", b"a", b"record")
    assert remote.get(key(1)) is None and remote.corrupt == 1
    assert not admin.exists(remote.prefix + key(1))
    remote.put(key(1), make_entry())
    assert remote.flush(5) and remote.get(key(1)) is not None


def test_hung_redis_delays_a_lookup_by_the_read_timeout_only(redis_server: RedisServer):
    tier = RemoteTier(redis_server.url, read_timeout_s=0.1, retry_after_s=0.5)
    try:
        tier.put(key(1), make_entry())
        assert tier.flush(5)
        assert redis_server.process is not None
        redis_server.process.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        assert tier.get_many([key(1), key(2)]) == [None, None]
        assert tier.get(key(1)) is None  # in the back-off: no network call at all
        assert time.monotonic() - started < 1.0
        redis_server.process.send_signal(signal.SIGCONT)
        time.sleep(0.6)
        assert tier.get(key(1)) is not None
    finally:
        if redis_server.process is not None:
            redis_server.process.send_signal(signal.SIGCONT)
        tier.close(timeout_s=2)


def test_ttl_option_sets_an_expiry(redis_server: RedisServer):
    tier = RemoteTier(redis_server.url, ttl_s=30)
    try:
        tier.put(key(1), make_entry())
        tier.note_tail(key(2), frozenset({4}))
        assert tier.flush(5)
        admin = redis_server.client()
        assert 0 < admin.pttl(tier.prefix + key(1)) <= 30_000
        assert 0 < admin.pttl(tier.prefix + "tail:" + key(2)) <= 30_000
        assert tier.tail_lengths(key(2)) == {4}
    finally:
        tier.close(timeout_s=2)


def test_hmac_refuses_records_forged_without_the_secret(redis_server: RedisServer):
    sealed = RemoteTier(redis_server.url, hmac_key="s3cret")
    other_secret = RemoteTier(redis_server.url, hmac_key="other")
    try:
        sealed.put(key(1), make_entry(seed=1))
        assert sealed.flush(5)
        got = sealed.get(key(1))
        assert got is not None
        assert_same(got, make_entry(seed=1))
        admin = redis_server.client()
        admin.set(sealed.prefix + key(2), bytes(codec.encode(key(2), make_entry(seed=2))))  # valid, unsealed
        assert sealed.get(key(2)) is None and sealed.corrupt == 1
        assert other_secret.get(key(1)) is None and other_secret.corrupt == 1
    finally:
        sealed.close(timeout_s=2)
        other_secret.close(timeout_s=2)


def test_clear_leaves_a_longer_prefix_alone(remote: RemoteTier, redis_server: RedisServer):
    """A tenant whose prefix extends this one ("kvboost:" and "kvboost:tenant-b:") keeps its records."""
    other = RemoteTier(redis_server.url, prefix="kvboost:tenant-b:")
    try:
        remote.put(key(1), make_entry())
        other.put(key(2), make_entry(seed=2))
        remote.note_tail(key(1), frozenset({3}))
        assert remote.flush(5) and other.flush(5)
        remote.clear()
        assert remote.get(key(1)) is None and remote.tail_lengths(key(1)) == set()
        assert other.get(key(2)) is not None
    finally:
        other.clear()
        other.close()


def test_an_entry_no_record_can_hold_is_lost_alone(remote: RemoteTier):
    """An entry the codec refuses (int32 K/V) is counted lost; its batch-mates are written (the whole batch was
    lost and nothing counted)."""
    bad = ChunkKV(torch.zeros(2, 3, 4, 8, dtype=torch.int32), torch.zeros(2, 3, 4, 8, dtype=torch.int32))
    for i in range(6):
        remote.put(key(i), bad if i == 3 else make_entry(seed=i))
    remote.flush(5)
    assert [remote.get(key(i)) is not None for i in range(6)] == [True, True, True, False, True, True]
    assert remote.dropped == 1
