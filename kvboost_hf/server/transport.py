"""The server's HTTP/1.1 connections: uvicorn's h11 protocol with time bounds on reading a request and a cap on
the connections one client address may hold open.

Bounds (each applies to reading the request only; writing the response, however long, is never timed here):

* headers: a connection must deliver a request's complete headers within ``header_timeout_s`` of opening or of
  its previous response ending (h11 still waiting for a request: ``their_state is IDLE``), else it gets a 408 and
  is closed;
* body: a request's whole body must arrive within ``body_timeout_s`` of its headers, plus
  :data:`BODY_GRACE_S` so that the app's own 408 (:class:`~kvboost_hf.server.gate.RequestGate`, with its message)
  goes first while the app reads the body. Past that the connection is closed, after a 408 when no response has
  started (bytes the app never reads, e.g. after an early 401 or 413, are bounded the same way);
* connections: a client address may hold ``max_connections_per_client`` connections open at once (0: no cap);
  one more is answered 429 and closed as soon as its request line shows a path other than :data:`EXEMPT_PATHS`
  (``/health`` and ``/metrics``: a monitor or a load balancer probing through a reverse proxy shares the address
  of the clients it watches), which are served on it, one request, then the connection is closed; one that
  shows nothing within :data:`OVER_CAP_WAIT_S` gets the 429 then. Behind a
  reverse proxy every client shares the proxy's address: raise the cap or set it to 0 there.

uvicorn itself bounds only idle keep-alive time.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["BODY_GRACE_S", "EXEMPT_PATHS", "TIMEOUT_RESPONSE", "bounded_protocol"]
EXEMPT_PATHS = frozenset({b"/health", b"/metrics"})  # served over the per-address connection cap
BODY_GRACE_S = 1.0  # seconds past body_timeout_s before the connection itself is cut
OVER_CAP_WAIT_S = 1.0  # seconds a connection over the cap gets to show its request line before its 429
TIMEOUT_RESPONSE = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


def _too_many_connections_response(limit: int) -> bytes:
    """A complete 429 response (OpenAI-style error body) refusing a connection over the per-address cap."""
    message = f"this address already holds {limit} open connections (this server's limit); reuse or close some"
    body = json.dumps(
        {"error": {"message": message, "type": "rate_limit_error", "param": None, "code": "too_many_connections"}}
    ).encode()
    head = (
        "HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def bounded_protocol(header_timeout_s: float, body_timeout_s: float, max_connections_per_client: int) -> type:
    """uvicorn's h11 protocol with the bounds of this module (one class per server: it owns the per-address
    connection counts of that server's connections)."""
    open_per_address: Counter[str] = Counter()
    refusal = _too_many_connections_response(max_connections_per_client)

    class BoundedProtocol(H11Protocol):
        address: str | None = None  # the client address counted in open_per_address (None: not counted)
        over_cap = False  # opened over the cap: only one request to EXEMPT_PATHS is served, then it closes
        request_line: bytes | None = b""  # what arrived of an over-cap connection's request line (None: decided)
        header_timer: asyncio.TimerHandle | None = None
        body_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)  # type: ignore[arg-type]
            address = self.client[0] if self.client else ""
            if max_connections_per_client and open_per_address[address] >= max_connections_per_client:
                self.over_cap = True  # decided once its request line is in (data_received), 429 if late
                self.header_timer = self.loop.call_later(min(header_timeout_s, OVER_CAP_WAIT_S), self._headers_late)
                return
            open_per_address[address] += 1
            self.address = address
            self.header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def data_received(self, data: bytes) -> None:
            if self.over_cap and self.request_line is not None:
                self.request_line += data
                if b"\n" not in self.request_line and len(self.request_line) < 8192:
                    super().data_received(data)  # the line is not complete yet: h11 buffers it
                    return
                target = self.request_line.split(b"\n", 1)[0].split(b" ")
                self.request_line = None
                path = target[1].split(b"?", 1)[0] if len(target) > 1 else b""
                if path not in EXEMPT_PATHS:
                    self._cancel_timers()
                    self.transport.write(refusal)
                    self.transport.close()
                    return
            super().data_received(data)

        def handle_events(self) -> None:
            super().handle_events()
            self._follow_request()

        def on_response_complete(self) -> None:
            if self.over_cap:  # its one exempt request answered: it holds no place under the cap
                self._cancel_timers()
                self.transport.close()
            super().on_response_complete()  # keep-alive: the next request's cycle starts (IDLE) unless closing
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._cancel_timers()
                self.header_timer = self.loop.call_later(header_timeout_s, self._headers_late)
            self._follow_request()  # a pipelined request may already be in

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_timers()
            if self.address is not None:
                open_per_address[self.address] -= 1
                if open_per_address[self.address] <= 0:
                    del open_per_address[self.address]
                self.address = None
            super().connection_lost(exc)

        def _follow_request(self) -> None:
            """Move the timers along h11's view of the client: headers in (not IDLE) ends the header timer and,
            while the body comes (SEND_BODY), starts the body timer; the body complete ends the body timer."""
            state = self.conn.their_state
            if self.header_timer is not None and state is not h11.IDLE:
                self.header_timer.cancel()
                self.header_timer = None
                if state is h11.SEND_BODY:
                    self.body_timer = self.loop.call_later(body_timeout_s + BODY_GRACE_S, self._body_late)
            if self.body_timer is not None and state is not h11.SEND_BODY:
                self.body_timer.cancel()
                self.body_timer = None

        def _cancel_timers(self) -> None:
            for timer in (self.header_timer, self.body_timer):
                if timer is not None:
                    timer.cancel()
            self.header_timer = self.body_timer = None

        def _headers_late(self) -> None:
            self.header_timer = None
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self.transport.write(refusal if self.over_cap else TIMEOUT_RESPONSE)
                self.transport.close()

        def _body_late(self) -> None:
            self.body_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
                return
            cycle = self.cycle
            if cycle is not None:
                if not cycle.response_started:
                    self.transport.write(TIMEOUT_RESPONSE)
                cycle.disconnected = True  # the app's receive() now reports a disconnect; its sends are dropped
                cycle.message_event.set()
            self.transport.close()

    return BoundedProtocol
