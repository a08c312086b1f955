"""``python -m kvboost_hf.bench hardening``: abusive loads against two server builds, side by side in one run.

Each ``--source`` is a directory holding a ``kvboost_hf`` package (e.g. this checkout, and ``git archive`` of an
older commit unpacked elsewhere); its server runs as ``python -m kvboost_hf.server`` from that directory on a free
127.0.0.1 port, default flags, after one plain chat to warm it. Per build, three loads, each bounded:

* ``schemas`` (issue #22 item 6): ``--schema-requests`` chat requests at once, each with its own tenant
  (``cache_salt``) and a ~150 KiB enum schema; measured: the worst latency of a plain one-token chat sent
  meanwhile, and the status codes. Then the cross-tenant timing probe: tenant A compiles a fresh mid-sized schema,
  tenant B sends the same schema, and B's time is compared with B sending a schema nobody compiled (mean gap).
* ``parts`` (item 7): 8 bodies of 120k text parts (~3.5 MiB) at once; measured: worst ``/health`` latency.
* ``loris`` (item 9): ``--connections`` sockets that send half a request header and stop; measured: how many the
  server still holds after ``--hold-s`` seconds and the worst ``/health`` latency meanwhile.

Before the loads, on the fresh server (issue #40 item 2): the seconds from the server's first ``/health`` 200 until
it reports its compile processes up (``structured_output: ready``), then the seconds of a structured (small JSON
schema) one-token chat, its first request, and the same for a second schema (a warm server's compile); then the
memory of the server's child processes (the compile processes, and the fork server where there is one): their
count, summed RSS and summed PSS (pages shared between them counted once; Linux only).

Issue #30 (``--loads`` picks a subset; every load runs by default):

* ``close`` (item 2): a streamed chat of ``--close-tokens`` tokens (``ignore_eos``) with ``Connection: close``;
  measured: seconds, status, ``408`` bytes in the reply, whether it ends with ``[DONE]``;
* ``pattern`` (item 3): tenant A sends two schemas with ``"pattern": "[a-z]{1,30000}"`` (and 30001) at once while
  tenant B sends small structured chats one after another for ``--pattern-s`` seconds, each tenant from its own
  loopback address (127.0.0.2 and 127.0.0.3: compile admission is per client address); measured: B's codes and
  worst latency, A's codes and seconds;
* ``drip`` (item 5): ``--drip-connections`` bodies dripped one byte a second; measured: how many the server still
  holds after ``--drip-hold-s`` seconds; then ``--idle-connections`` idle sockets from one address: how many were
  refused at once (429) and the worst ``/health`` latency meanwhile;
* ``warm`` (item 6): ``/v1/warm`` with 256 documents of ~100 tokens while a one-token chat is sent; measured: the
  chat's and the warm's seconds; then a one-token chat 0.5 s after a client that asked for 256 more documents
  disconnected at 1 s (the worker still warming for nobody shows in its time).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import socket
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from kvboost_hf.bench.serve import MODEL, ServerProcess

logger = logging.getLogger(__name__)

MESSAGES = [{"role": "user", "content": "Say hi."}]


def timed_post(
    url: str, body: dict[str, Any] | bytes, timeout: float = 120.0, source: str | None = None
) -> tuple[float, int]:
    """(seconds, status) of one POST (status 0 when the request failed at the transport level), on a client built
    before the clock starts (building one loads the CA bundle: 0.1-0.25 s of CPU here, not the server's time).
    ``source``: the local address to send from (a loopback address such as 127.0.0.2 is another client to the
    server's per-address admission; Linux answers on all of 127.0.0.0/8), None: the system's choice."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    transport = None if source is None else httpx.HTTPTransport(local_address=source)
    with httpx.Client(timeout=timeout, transport=transport) as client:
        start = time.perf_counter()
        try:
            response = client.post(url, content=content, headers={"Content-Type": "application/json"})
        except httpx.HTTPError:
            return time.perf_counter() - start, 0
        seconds = time.perf_counter() - start
    if response.status_code != 200:
        logger.warning("%s: %d %s", url, response.status_code, response.text[:200])
    return seconds, response.status_code


def worst_latency_during(probe: Callable[[], float], load: Callable[[], Any]) -> tuple[float, Any]:
    """Runs ``load`` in a thread while calling ``probe`` (returns seconds) back to back: (worst probe, result)."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(load()))
    thread.start()
    worst = 0.0
    while thread.is_alive():
        worst = max(worst, probe())
        time.sleep(0.05)
    thread.join()
    return worst, result[0] if result else None


def health_probe(url: str) -> Callable[[], float]:
    """Seconds one ``GET /health`` takes, on a new connection each time (as a new client's, so a full accept queue
    shows), through one client built here: ``httpx.get`` builds one per call, loading the CA bundle (0.1-0.25 s of
    CPU here), which counted in the latency measured."""
    client = httpx.Client(timeout=60, limits=httpx.Limits(max_keepalive_connections=0))

    def probe() -> float:
        start = time.perf_counter()
        try:
            client.get(f"{url}/health")
        except httpx.HTTPError:
            return 60.0
        return time.perf_counter() - start

    return probe


def enum_schema(values: int, tag: str) -> dict[str, Any]:
    return {"type": "string", "enum": [f"{tag}-option-{i:06d}" for i in range(values)]}


def chat_body(schema: dict[str, Any] | None, salt: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1, "cache_salt": salt}
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    return body


def schemas_load(url: str, requests: int) -> dict[str, Any]:
    chat_url = f"{url}/v1/chat/completions"
    big = [chat_body(enum_schema(6000, f"big{i}"), f"tenant-{i}") for i in range(requests)]
    with ThreadPoolExecutor(requests) as pool:
        worst, codes = worst_latency_during(
            lambda: timed_post(chat_url, chat_body(None, "plain"))[0],
            lambda: sorted(code for _, code in pool.map(lambda b: timed_post(chat_url, b), big)),
        )
    gaps = []
    for trial in range(3):  # tenant B: a schema tenant A compiled just before, against one nobody compiled
        shared, fresh = enum_schema(400, f"shared{trial}"), enum_schema(400, f"fresh{trial}")
        timed_post(chat_url, chat_body(shared, "tenant-a"))
        seen, _ = timed_post(chat_url, chat_body(shared, "tenant-b"))
        unseen, _ = timed_post(chat_url, chat_body(fresh, "tenant-b"))
        gaps.append(unseen - seen)
    return {"plain_chat_worst_s": worst, "codes": codes, "cross_tenant_gap_s": statistics.mean(gaps)}


def parts_load(url: str) -> dict[str, Any]:
    parts = [{"type": "text", "text": "x"}] * 120_000
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": parts}], "max_tokens": 1}).encode()
    with ThreadPoolExecutor(8) as pool:
        worst, codes = worst_latency_during(
            health_probe(url),
            lambda: sorted(
                code for _, code in pool.map(lambda _: timed_post(f"{url}/v1/chat/completions", body), range(8))
            ),
        )
    return {"health_worst_s": worst, "codes": codes, "body_bytes": len(body)}


def loris_load(url: str, port: int, connections: int, hold_s: float) -> dict[str, Any]:
    sockets = []
    for _ in range(connections):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        sockets.append(sock)

    def hold() -> int:
        time.sleep(hold_s)
        held = 0
        for sock in sockets:
            sock.setblocking(False)
            try:
                sock.recv(1)  # data (a 408) or end of stream: the server let go
            except BlockingIOError:
                held += 1  # nothing: the server still holds it
            except OSError:
                pass
            sock.close()
        return held

    worst, held = worst_latency_during(health_probe(url), hold)
    return {"held_after_s": held, "health_worst_s": worst}


def close_load(port: int, tokens: int) -> dict[str, Any]:
    payload = {**chat_body(None, "close"), "max_tokens": tokens, "ignore_eos": True, "stream": True}
    body = json.dumps(payload).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=300) as sock:
        sock.sendall(head.encode() + body)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return {
        "seconds": time.perf_counter() - start,
        "status": reply[9:12].decode(errors="replace"),
        "raw_408": reply.count(b"HTTP/1.1 408"),
        "done": b"data: [DONE]" in reply,
    }


#: the pattern load's two clients: compile admission is counted per client address, so each sends from its own
TENANT_A_ADDRESS, TENANT_B_ADDRESS = "127.0.0.2", "127.0.0.3"


def pattern_load(url: str, seconds: float) -> dict[str, Any]:
    chat_url = f"{url}/v1/chat/completions"
    slow = [chat_body({"type": "string", "pattern": f"[a-z]{{1,{30000 + i}}}"}, "tenant-a") for i in range(2)]
    small = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    timed_post(chat_url, chat_body(small, "warm-up"))  # compile processes up (new build)
    with ThreadPoolExecutor(2) as pool:
        attacks = [pool.submit(timed_post, chat_url, body, 300.0, TENANT_A_ADDRESS) for body in slow]
        time.sleep(0.5)
        tenant_b: list[tuple[float, int]] = []
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            body = chat_body(small, f"tenant-b-{len(tenant_b)}")
            tenant_b.append(timed_post(chat_url, body, source=TENANT_B_ADDRESS))
        tenant_a = [attack.result() for attack in attacks]
    return {
        "tenant_b_codes": dict(Counter(code for _, code in tenant_b)),
        "tenant_b_worst_s": max(s for s, _ in tenant_b),
        "tenant_a": [(round(s, 2), code) for s, code in tenant_a],
    }


def drip_load(url: str, port: int, connections: int, hold_s: float, idle: int) -> dict[str, Any]:
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
    )
    sockets = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(connections)]
    for sock in sockets:
        sock.sendall(head)
    deadline = time.perf_counter() + hold_s
    while time.perf_counter() < deadline:
        time.sleep(1.0)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.sendall(b" ")
    held = 0
    for sock in sockets:
        sock.setblocking(False)
        try:
            sock.recv(1)  # an answer or the end of stream: the server let go
        except BlockingIOError:
            held += 1  # nothing: the server still holds it
        except OSError:
            pass
        sock.close()

    def open_idle() -> int:
        refused, opened = 0, []
        for _ in range(idle):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            opened.append(sock)
            sock.settimeout(0.05)
            with contextlib.suppress(TimeoutError):
                refused += sock.recv(12).startswith(b"HTTP/1.1 429")
        for sock in opened:
            sock.close()
        return refused

    worst, refused = worst_latency_during(health_probe(url), open_idle)
    return {"dripping_held": held, "idle_refused": refused, "health_worst_s": worst}


def warm_load(url: str) -> dict[str, Any]:
    tag = time.time_ns()
    docs = [f"Doc {tag}-{i}. " + " ".join(f"w{(i * 7 + j) % 97}" for j in range(45)) for i in range(512)]
    warm_url, chat_url = f"{url}/v1/warm", f"{url}/v1/chat/completions"
    with ThreadPoolExecutor(1) as pool:
        warming = pool.submit(timed_post, warm_url, {"documents": docs[:256]}, 600.0)
        time.sleep(0.5)
        chat_s, chat_code = timed_post(chat_url, chat_body(None, "other"))
        warm_s, warm_code = warming.result()
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(warm_url, json={"documents": docs[256:]}, timeout=1.0)  # the client leaves after 1 s
    time.sleep(0.5)
    after_s, after_code = timed_post(chat_url, chat_body(None, "other"))
    return {
        "chat_during_warm_s": chat_s,
        "warm_s": warm_s,
        "chat_after_disconnect_s": after_s,
        "codes": [chat_code, warm_code, after_code],
    }


def descendants_memory(pid: int) -> dict[str, Any] | None:
    """Count, summed RSS and summed PSS (MiB) of every descendant of process ``pid``, from /proc (None without it:
    not Linux)."""
    proc = Path("/proc")
    if not (proc / str(pid)).exists():
        return None
    found: list[int] = []
    pending = [pid]
    while pending:
        parent = pending.pop()
        for task in (proc / str(parent) / "task").glob("*/children"):
            with contextlib.suppress(OSError):
                pending.extend(int(child) for child in task.read_text().split())
        if parent != pid:
            found.append(parent)
    totals = {"processes": 0, "rss_mib": 0.0, "pss_mib": 0.0}
    for child in found:
        with contextlib.suppress(OSError):  # it exited meanwhile
            rollup = (proc / str(child) / "smaps_rollup").read_text().splitlines()[1:]  # after its header line
            fields = dict(line.split(":", 1) for line in rollup)
            totals["rss_mib"] += int(fields["Rss"].split()[0]) / 1024
            totals["pss_mib"] += int(fields["Pss"].split()[0]) / 1024
            totals["processes"] += 1
    return {k: round(v, 1) for k, v in totals.items()}


def run_loads(server: ServerProcess, args: argparse.Namespace) -> dict[str, Any]:
    """The results of the loads ``args.loads`` names against ``server``, in order."""
    loads: dict[str, Callable[[], dict[str, Any]]] = {
        "schemas": lambda: schemas_load(server.url, args.schema_requests),
        "parts": lambda: parts_load(server.url),
        "loris": lambda: loris_load(server.url, server.port, args.connections, args.hold_s),
        "close": lambda: close_load(server.port, args.close_tokens),
        "pattern": lambda: pattern_load(server.url, args.pattern_s),
        "drip": lambda: drip_load(
            server.url, server.port, args.drip_connections, args.drip_hold_s, args.idle_connections
        ),
        "warm": lambda: warm_load(server.url),
    }
    return {name: loads[name]() for name in args.loads}


LOADS = ("schemas", "parts", "loris", "close", "pattern", "drip", "warm")
FIRST_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
WARM_SCHEMA = {"type": "object", "properties": {"reply": {"type": "string"}}, "required": ["reply"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvboost_hf.bench hardening", description=__doc__)
    parser.add_argument("--source", action="append", type=Path, required=True, help="directory with kvboost_hf")
    parser.add_argument("--schema-requests", type=int, default=7)
    parser.add_argument("--connections", type=int, default=300)
    parser.add_argument("--hold-s", type=float, default=15.0)
    parser.add_argument("--loads", nargs="+", choices=LOADS, default=list(LOADS), help="which loads to run")
    parser.add_argument("--close-tokens", type=int, default=300)
    parser.add_argument("--pattern-s", type=float, default=20.0)
    parser.add_argument("--drip-connections", type=int, default=50)
    parser.add_argument("--drip-hold-s", type=float, default=35.0)
    parser.add_argument("--idle-connections", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    results: dict[str, Any] = {}
    for source in args.source:
        env = {**os.environ, "PYTHONPATH": str(source.resolve())}
        server = ServerProcess([], startup_timeout_s=300, env=env, cwd=source.resolve())
        try:
            started = time.perf_counter()
            with httpx.Client(timeout=10) as client:  # one client for the polls (each builds an SSL context)
                while client.get(f"{server.url}/health").json().get("structured_output") == "starting":
                    if time.perf_counter() - started > 300:
                        break
                    time.sleep(0.1)
            first: dict[str, Any] = {"structured_output_ready_after_s": time.perf_counter() - started}
            for name, schema in (("first", FIRST_SCHEMA), ("warm", WARM_SCHEMA)):  # each compiles: a new schema
                seconds, status = timed_post(f"{server.url}/v1/chat/completions", chat_body(schema, name))
                first[f"{name}_structured_request"] = {"seconds": seconds, "status": status}
            first["child_processes_memory"] = descendants_memory(server.process.pid)
            timed_post(f"{server.url}/v1/chat/completions", chat_body(None, "plain"))
            results[str(source)] = {**first, **run_loads(server, args)}
        finally:
            server.stop()
        print(json.dumps({str(source): results[str(source)]}, indent=1), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
