"""Every error leaves the server as OpenAI's envelope: {"error": {message, type, param, code}}.

No stack traces and no file paths reach a client; a real internal fault is logged here and
answered with a plain 500.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from ember.errors import EmberError, InvalidRequest, RequestFailed, TooManySequences

log = logging.getLogger(__name__)


class Unauthorized(EmberError):
    http_status = 401
    error_type = "authentication_error"


class Forbidden(EmberError):
    """The key is valid but may not ask for this (a priority above its allowance)."""

    http_status = 403
    error_type = "permission_error"


class NotFound(EmberError):
    http_status = 404
    error_type = "not_found_error"


class PayloadTooLarge(InvalidRequest):
    http_status = 413


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, refused with PayloadTooLarge as soon as it is declared or read past
    `limit` bytes (a body is never buffered whole before its size is known). A client that
    leaves before sending all of it raises ClientDisconnected (a quiet 499, not a fault)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"the body has {declared} bytes; the limit is {limit}")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"the body is over the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientDisconnected() from None
    return b"".join(chunks)


class Unavailable(EmberError):
    http_status = 503
    error_type = "unavailable_error"


class ClientDisconnected(Exception):
    """The client went away; nobody is left to answer."""


RETRY_AFTER_S = 1
# Says whose fault a 5xx is, for a router in front: "request" means this request failed (or
# ran past its time limit) and the server is fine, so sending it elsewhere would fail the
# same way and the server must stay in rotation. A 5xx without it is the server's own.
FAULT_HEADER = "X-Ember-Fault"
REQUEST_FAULT = {FAULT_HEADER: "request"}


def is_request_fault(error: EmberError) -> bool:
    """Whether `error` is the one request's own outcome (the engine keeps serving others):
    RequestFailed, the request's time limit (504), or more sequences than the queue takes."""
    return isinstance(error, (RequestFailed, TooManySequences)) or error.http_status == 504


def error_body(status: int, message: str, error_type: str, param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param,
                      "code": code if code is not None else status}}


def error_response(error: EmberError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if error.http_status in (429, 503) else None
    if error.http_status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    if is_request_fault(error):
        headers = {**(headers or {}), **REQUEST_FAULT}
    body = error_body(error.http_status, error.message, error.error_type, error.param)
    return JSONResponse(body, status_code=error.http_status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(EmberError)
    async def ember_error(_: Request, error: EmberError) -> JSONResponse:
        if error.http_status >= 500 and error.http_status != 503:
            log.error("request failed: %s", error.message)
        return error_response(error)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        if error.status_code == 404:
            message = f"there is no route {request.method} {request.url.path}; see /v1/models, " \
                      "/v1/completions, /v1/chat/completions"
            return JSONResponse(error_body(404, message, "not_found_error"), status_code=404)
        if error.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
            return JSONResponse(error_body(405, message, "invalid_request_error"),
                                status_code=405, headers=error.headers)
        return JSONResponse(error_body(error.status_code, str(error.detail), "server_error"),
                            status_code=error.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, error: Exception) -> JSONResponse:
        # a bug this request ran into: every replica runs the same code on the same body,
        # and the server itself is fine (a dead engine answers 503 EngineDead)
        log.exception("internal error")
        return JSONResponse(error_body(500, "internal server error; the request was not "
                                            "completed, and the server logged the cause",
                                       "server_error"), status_code=500,
                            headers=REQUEST_FAULT)
