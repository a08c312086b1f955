"""The server's request gate (ASGI middleware): the API key, then the body size limit and time, before the app.

Light to import (no model code), so that the Ray Serve ingress, which checks requests before routing them, does not
load what the engine needs.
"""

from __future__ import annotations

import asyncio
import secrets

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvboost_hf.server.errors import ApiError

#: paths served without the API key
PUBLIC_PATHS = frozenset({"/health"})


class _BodyTooLarge(StarletteHTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds this server's limit of {limit} bytes")


class _BodyTimeout(StarletteHTTPException):
    def __init__(self, seconds: float) -> None:
        super().__init__(408, f"the request body did not arrive in time (within {seconds:g} s of its headers)")


class RequestGate:
    """ASGI middleware: API key from the headers first, then the body size limit, then the app. The whole body must
    arrive within ``body_timeout_s`` of the request reaching the app (408 after, while the app reads it)."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int, body_timeout_s: float) -> None:
        self.app, self.max_body_bytes, self.body_timeout_s = app, max_body_bytes, body_timeout_s
        self.api_key = api_key.encode() if api_key is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        public = self.api_key is None or scope["path"] in PUBLIC_PATHS
        if not (public or self._authorized(headers.get(b"authorization", b""))):
            message = "missing or invalid API key (send 'Authorization: Bearer <key>')"
            await ApiError(401, message, code="invalid_api_key").response()(scope, receive, send)
            return
        declared = headers.get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.max_body_bytes:
            exc = _BodyTooLarge(self.max_body_bytes)
            await ApiError(413, str(exc.detail), code="body_too_large").response()(scope, receive, send)
            return
        received, complete = 0, False
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s

        async def counted() -> Message:
            nonlocal received, complete
            if complete:  # after the body: waits for a disconnect (streaming responses) are not bounded
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except TimeoutError:
                raise _BodyTimeout(self.body_timeout_s) from None
            complete = not message.get("more_body", False)
            received += len(message.get("body", b""))
            if received > self.max_body_bytes:
                raise _BodyTooLarge(self.max_body_bytes)  # FastAPI passes HTTP errors through: a 413 body
            return message

        await self.app(scope, counted, send)

    def _authorized(self, header: bytes) -> bool:
        """Whether an ``Authorization`` header carries the key as a bearer token (the scheme in any case, as
        RFC 9110 reads it: some clients send ``bearer``)."""
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(b" "), self.api_key or b"")
