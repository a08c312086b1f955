"""``bench hardening``'s request timer: the status of each outcome, and the server's seconds only."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from helpers import free_port

from kvboost_hf.bench.hardening import timed_post


class _Answer(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
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
