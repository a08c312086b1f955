"""``bench hardening``'s request timer (the status of each outcome, and the server's seconds only) and its memory
figure of a server's child processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from helpers import free_port

from kvboost_hf.bench.hardening import descendants_memory, timed_post

SOURCES: list[str] = []  # the client address of each request the test server answered


class _Answer(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        SOURCES.append(self.client_address[0])
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200 if self.path == "/ok" else 400)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_timed_post_reports_the_status_of_each_outcome(url, caplog):
    seconds, status = timed_post(f"{url}/ok", {"a": 1})
    assert status == 200 and 0 < seconds < 10
    assert timed_post(f"{url}/bad", b"{}")[1] == 400 and "400" in caplog.text
    assert timed_post(f"http://127.0.0.1:{free_port()}/ok", {}, timeout=5)[1] == 0  # nothing listens there


@pytest.mark.skipif(sys.platform != "linux", reason="Linux answers on all of 127.0.0.0/8")
def test_timed_post_sends_from_the_source_address_it_is_given(url):
    """The pattern load's tenants are two clients to the server's per-address admission."""
    SOURCES.clear()
    assert timed_post(f"{url}/ok", {}, source="127.0.0.3")[1] == 200 and timed_post(f"{url}/ok", {})[1] == 200
    assert SOURCES == ["127.0.0.3", "127.0.0.1"]


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="reads /proc (Linux 4.14+)")
def test_descendants_memory_counts_children_and_grandchildren_once():
    """A child holding a grandchild: two descendants of this process, one of the child; PSS (shared pages split
    between the processes sharing them) is at most RSS."""
    grandchild = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])"
    child = subprocess.Popen(
        [sys.executable, "-c", f"{grandchild}; print('up', flush=True); time.sleep(30)"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "up"
        memory = descendants_memory(os.getpid())
        own = descendants_memory(child.pid)
    finally:
        os.killpg(child.pid, signal.SIGKILL)  # the child and the grandchild: one session
        child.wait()
    assert own is not None and own["processes"] == 1 and 0 < own["pss_mib"] <= own["rss_mib"]
    assert memory is not None and memory["processes"] >= 2  # the child and the grandchild (both still starting)
    assert descendants_memory(2**22 + 1) is None  # no such process
