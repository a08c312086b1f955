"""OpenAI-style errors: ``{"error": {message, type, param, code}}`` for every failure, validation included."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvboost_hf.core.errors import KVBoostError

logger = logging.getLogger(__name__)

_ERROR_KINDS = {
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class ApiError(KVBoostError):
    """An error answered with an OpenAI-style body; ``kind`` defaults from the status code."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.kind = _ERROR_KINDS.get(status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as ``{"error": {...}}``; validation problems are 400s whose ``param`` names the field."""

    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return exc.response()

    async def validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        errors = list(exc.errors()) or [{"loc": (), "msg": "invalid request"}]
        # a union (e.g. str | list of parts) reports one error per member: our own checks' messages say more
        first = next((e for e in errors if e.get("type") == "value_error"), errors[0])
        if first.get("type") == "json_invalid":
            return ApiError(400, "request body is not valid JSON").response()
        # skip "body" and the union-member tags pydantic adds (e.g. "str", "list[ContentPart]")
        parts = [str(p) for p in first.get("loc", ()) if p != "body" and (isinstance(p, int) or "[" not in str(p))]
        parts = [p for p in parts if p not in ("str", "int", "float", "bool", "function-after")]
        where = ".".join(parts)
        if first.get("type") == "extra_forbidden":
            message = f"unsupported field {where!r}: this server does not implement it"
        else:
            message = f"{where or 'body'}: {first.get('msg')}"
        return ApiError(400, message, param=where or None).response()

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return ApiError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)).response()

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        # Starlette re-raises after sending this, and uvicorn then drops the connection: say so, so a client does not
        # send its next request on it (it was reset)
        return ApiError(500, f"internal error: {type(exc).__name__}", headers={"Connection": "close"}).response()

    handlers: dict[type[Exception], Callable[[Request, Exception], Awaitable[JSONResponse]]] = {
        ApiError: api_error,
        RequestValidationError: validation_error,
        StarletteHTTPException: http_error,
        Exception: unexpected,
    }
    for kind, handler in handlers.items():
        app.add_exception_handler(kind, handler)
