"""What every HTTP endpoint shares: OpenAI-shaped errors, bearer tokens, bodies, names.

Errors follow the OpenAI API: `{"error": {"message", "type", "param", "code"}}` with the
HTTP status that says what went wrong (400 bad request, 401 no or unknown token, 403 a
read-only token writing, a non-admin token on an admin route, or a foreign Origin / Host
(edge.py), 404 unknown model / session / question, 413 body too large, 415 a body that is
not `application/json`, 503 no capacity); never a traceback. `code` is the websocket
protocol's stable code.

A token comes in `Authorization: Bearer`; only the SSE events route, which browsers open with
`EventSource` (no headers), also takes `?token=`. Anywhere else a token in the URL is refused
(401): URLs end up in logs, histories and Referer headers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from streamllm.service import protocol as p
from streamllm.service.connection import CapExceeded
from streamllm.service.edge import FORBIDDEN_HOST, FORBIDDEN_ORIGIN
from streamllm.service.errors import engine_error
from streamllm.service.quotas import QuotaExceeded
from streamllm.service.shared import bearer
from streamllm.service.tenants import LOCAL, Tenant

if TYPE_CHECKING:
    from streamllm.service.server import StreamServer

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
               415: "invalid_request_error", 503: "server_error", 500: "server_error", 504: "server_error"}
UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"  # a POST body that does not say Content-Type: application/json
CODE_STATUS = {p.BAD_JSON: 400, p.BAD_FIELD: 400, p.CONFIG_ERROR: 400, p.TOO_LARGE: 413, p.UNAUTHORIZED: 401,
               p.FORBIDDEN: 403, p.UNKNOWN_SESSION: 404, p.UNKNOWN_QUESTION: 404, p.SESSION_EXISTS: 409,
               p.CAPACITY: 503, p.BUSY: 429, p.QUOTA: 429, p.INTERNAL: 500, p.UNAVAILABLE: 503, p.TIMEOUT: 504,
               FORBIDDEN_ORIGIN: 403, FORBIDDEN_HOST: 403, UNSUPPORTED_MEDIA_TYPE: 415}


class JsonResponse(Response):
    """orjson: faster than the stdlib, and a NaN or inf (a gate gap) becomes null, never a 500."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JsonResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JsonResponse(self.body(), status_code=self.status, headers=headers)


def from_engine(exc: BaseException, kind: str) -> ApiError:
    code, message = engine_error(exc, kind)
    return ApiError(CODE_STATUS.get(code, 500), message, code=code)


def tenant_of(server: StreamServer, request: Request, *, write: bool = False, admin: bool = False,
              query_token: bool = False) -> Tenant:
    """The request's tenant from `Authorization: Bearer`, or from `?token=` where `query_token` (the SSE
    route: EventSource sends no headers). `write`: 403 for a read-only token; `admin`: 403 unless an admin one."""
    if not server.tenants.auth:
        return LOCAL
    token = bearer(request.scope)
    if token is None and "token" in request.query_params:
        if not query_token:
            raise ApiError(401, f"a token in the URL is accepted only by GET /v1/sessions/{{name}}/events "
                                f"(EventSource); send 'Authorization: Bearer <token>' to {request.url.path}",
                           code=p.UNAUTHORIZED, param="token")
        token = request.query_params["token"]
    if not token:
        raise ApiError(401, "missing bearer token: send 'Authorization: Bearer <token>'", code=p.UNAUTHORIZED)
    tenant = server.tenants.authenticate(token)
    if tenant is None:
        raise ApiError(401, "unknown bearer token", code=p.UNAUTHORIZED)
    if write and tenant.read_only:
        raise ApiError(403, "this token is read-only: it may ask a session's questions and watch them, "
                            "not open sessions (a request without 'session' opens a temporary one)",
                       code=p.FORBIDDEN)
    if admin and not tenant.admin:
        raise ApiError(403, f"{request.url.path} needs an admin token (token file: "
                            "{ tenant = \"ops\", admin = true }); this one is tenant "
                            f"{tenant.name!r}'s", code=p.FORBIDDEN)
    return tenant


def sees_everything(server: StreamServer, request: Request) -> bool:
    """Whether this request may see engine-wide figures and every session's name (public routes such as
    /health and /metrics): on a server without tokens, or with an admin bearer token; never an error."""
    if not server.tenants.auth:
        return True
    token = bearer(request.scope)
    tenant = server.tenants.authenticate(token) if token else None
    return tenant is not None and tenant.admin


def hold_connection(server: StreamServer, tenant: Tenant) -> Callable[[], None]:
    """Count an HTTP request or SSE stream as one of the tenant's connections while it lasts (429
    `quota` when over its `connections`, 503 `capacity` over the server's `max_connections`); returns
    the release, which is safe to call twice."""
    try:
        slot = server.caps.admit(authenticated=True)
    except CapExceeded as exc:
        server.metrics.errors.labels(p.CAPACITY).inc()
        raise ApiError(503, str(exc), code=p.CAPACITY) from None
    try:
        server.quotas.hold_http(tenant.name, server.connections_of(tenant.name))
    except QuotaExceeded as exc:
        slot.release()
        server.metrics.errors.labels(p.QUOTA).inc()
        raise from_engine(exc, "connect") from None
    held = True

    def release() -> None:
        nonlocal held
        if held:
            held = False
            slot.release()
            server.quotas.release_http(tenant.name)

    return release


def session_name(name: Any, param: str = "session") -> str:
    if not isinstance(name, str) or not p.SESSION_NAME.match(name):
        raise ApiError(400, f"{param} {name!r} must be 1-64 letters, digits, '_', '.' or '-', starting with a "
                            "letter or digit", code=p.BAD_FIELD, param=param)
    return name


async def json_body(request: Request, limit: int) -> dict[str, Any]:
    """The request's JSON object; 415 unless `Content-Type: application/json` (a cross-site page may send
    `text/plain` without a CORS preflight, never JSON), 413 over `limit` bytes (checked while reading),
    400 if not an object."""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        raise ApiError(415, f"request body must be JSON sent with 'Content-Type: application/json', got "
                            f"{media_type[:100] or 'no Content-Type'!r}", code=UNSUPPORTED_MEDIA_TYPE)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body is {declared} bytes, over the limit of {limit}", code=p.TOO_LARGE)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body is over the limit of {limit} bytes", code=p.TOO_LARGE)
        chunks.append(chunk)
    try:
        data = orjson.loads(b"".join(chunks))
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", code=p.BAD_JSON) from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object", code=p.BAD_JSON)
    return data


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    what = {404: f"no such endpoint: {request.method} {request.url.path}",
            405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
    return ApiError(exc.status_code, what, code="not_found" if exc.status_code == 404 else None).response()


async def _any_error(request: Request, exc: Exception) -> Response:
    return from_engine(exc, request.url.path).response()


EXCEPTION_HANDLERS = {ApiError: _api_error, HTTPException: _http_error, Exception: _any_error}
