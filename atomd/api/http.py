"""aiohttp plumbing of the engine's HTTP server: request-head limits, OpenAI-style JSON errors
for what aiohttp's own parser refuses, JSON and SSE responses.
"""
from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import http_exceptions, web
from aiohttp.web_protocol import RequestHandler

from atomd.api import protocol

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}


# Limits on a request head (aiohttp's parser enforces them; router/http.py has the same):
# the request line, one header field, the number of headers. The body: --max-request-body-bytes.
MAX_LINE_BYTES = 8190


MAX_FIELD_BYTES = 8190


MAX_HEADERS = 128


HEAD_LIMITS = dict(max_line_size=MAX_LINE_BYTES, max_field_size=MAX_FIELD_BYTES, max_headers=MAX_HEADERS)


class JSONErrorRequestHandler(RequestHandler):
    """aiohttp's connection handler, whose own answers (a request its parser refused: a
    line or header over the limits, too many headers, not HTTP) are OpenAI-style JSON
    errors like every other, carrying no client bytes, trace or path. A malformed request
    is the client's, so it is logged at debug level, not with a traceback."""

    __slots__ = ()

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:  # as aiohttp: too late for an error answer
            raise ConnectionError("Response is sent already, cannot send another response with the error message")
        if status >= 500:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
        else:
            self.logger.debug("refused a request from %s: %r", request.remote, exc)
        code, kind = "bad_request", "invalid_request_error"
        if isinstance(exc, http_exceptions.LineTooLong):
            text = (f"the request line or a header is longer than {MAX_LINE_BYTES} bytes")
            code = "request_too_large"
        elif isinstance(exc, http_exceptions.BadHttpMessage) and "too many headers" in str(exc).lower():
            status, text, code = 431, f"more than {MAX_HEADERS} request headers", "request_too_large"
        elif status >= 500:
            text, kind, code = "internal error", "server_error", "internal_error"
        elif status == 504:
            text, kind, code = "timed out", "timeout", "timeout"
        else:
            text = f"malformed HTTP request ({type(exc).__name__ if exc else 'unknown'})"
        resp = error_response(protocol.APIError(status, text, type=kind, code=code))
        resp.force_close()
        return resp


class JSONErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        handler = super().__call__()
        handler.__class__ = JSONErrorRequestHandler  # same slots: only handle_error differs
        return handler


class JSONErrorRunner(web.AppRunner):
    """web.AppRunner whose connections answer parser errors with JSON (JSONErrorRequestHandler)."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = JSONErrorServer
        return server


def sse(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), status=status, content_type="application/json")


def error_response(e: protocol.APIError) -> web.Response:
    return web.Response(body=e.body(), status=e.status, content_type="application/json")
