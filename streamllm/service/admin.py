"""Operator routes of the front door (`serve --ray`): the replicas, and moving a session between them.

    GET  /v1/admin/replicas                 each replica's state, sessions, restarts, last recovery
    POST /v1/admin/sessions/{name}/move     {"to": REPLICA, "tenant": T}: snapshot + restore + placement
                                            (ClusterEngine.move_session); `tenant` (default: the token's
                                            own) names whose session `name` is

With tokens, both need an admin token (token file: `"tok" = { tenant = "ops", admin = true }`);
any other token gets 403 `forbidden`. A move stops the session's feeds on the source replica and
leaves a snapshot in `moves/`: an operator's act, not a tenant's. The CLI: `streamllm sessions
move`. Without tokens (loopback only) the one local user is the operator. A server without
--ray answers 404 with a message saying so.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from streamllm.engine.client import ReplicaControl
from streamllm.service import protocol as p
from streamllm.service.httpauth import (
    ApiError,
    JsonResponse,
    from_engine,
    json_body,
    session_name,
    tenant_of,
)
from streamllm.service.tenants import Tenant

if TYPE_CHECKING:
    from streamllm.service.server import StreamServer


def admin_routes(server: StreamServer) -> list[Route]:
    def cluster() -> ReplicaControl:
        if server.replicas is None:
            raise ApiError(404, "this server runs one engine (no --ray): there are no replicas to list or move "
                                "sessions between", code="not_found")
        return server.replicas

    async def replicas(request: Request) -> Response:
        tenant_of(server, request, admin=True)
        engine = cluster()
        return JsonResponse({"object": "list", "data": engine.replica_health()})

    async def move(request: Request) -> Response:
        tenant = tenant_of(server, request, write=True, admin=True)
        engine = cluster()
        local = session_name(request.path_params["name"], "name")
        body = await json_body(request, server.config.max_message_bytes)
        to = body.get("to")
        if not isinstance(to, int) or isinstance(to, bool):
            raise ApiError(400, f"'to' must be a replica index (0..{len(engine.replicas) - 1}), got {to!r}",
                           code=p.BAD_FIELD, param="to")
        owner = Tenant(session_name(body["tenant"], "tenant")) if body.get("tenant") is not None else tenant
        try:
            result = await asyncio.to_thread(engine.move_session, owner.engine_name(local), to)
        except Exception as exc:
            raise from_engine(exc, "move") from None
        result["session"] = local
        return JsonResponse(result)

    return [Route("/v1/admin/replicas", replicas, methods=["GET"]),
            Route("/v1/admin/sessions/{name}/move", move, methods=["POST"])]
