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
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from kvboost_hf.bench.serve import MODEL, ServerProcess

logger = logging.getLogger(__name__)

MESSAGES = [{"role": "user", "content": "Say hi."}]


def timed_post(url: str, body: dict[str, Any] | bytes, timeout: float = 120.0) -> tuple[float, int]:
    """(seconds, status) of one POST (status 0 when the request failed at the transport level)."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    start = time.perf_counter()
    try:
        response = httpx.post(url, content=content, headers={"Content-Type": "application/json"}, timeout=timeout)
        code = response.status_code
    except httpx.HTTPError:
        code = 0
    else:
        if code != 200:
            logger.warning("%s: %d %s", url, code, response.text[:200])
    return time.perf_counter() - start, code


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
    def probe() -> float:
        start = time.perf_counter()
        try:
            httpx.get(f"{url}/health", timeout=60)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvboost_hf.bench hardening", description=__doc__)
    parser.add_argument("--source", action="append", type=Path, required=True, help="directory with kvboost_hf")
    parser.add_argument("--schema-requests", type=int, default=7)
    parser.add_argument("--connections", type=int, default=300)
    parser.add_argument("--hold-s", type=float, default=15.0)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    results: dict[str, Any] = {}
    for source in args.source:
        env = {**os.environ, "PYTHONPATH": str(source.resolve())}
        server = ServerProcess([], startup_timeout_s=300, env=env, cwd=source.resolve())
        try:
            timed_post(f"{server.url}/v1/chat/completions", chat_body(None, "plain"))
            results[str(source)] = {
                "schemas": schemas_load(server.url, args.schema_requests),
                "parts": parts_load(server.url),
                "loris": loris_load(server.url, server.port, args.connections, args.hold_s),
            }
        finally:
            server.stop()
        print(json.dumps({str(source): results[str(source)]}, indent=1), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
