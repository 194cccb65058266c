"""The live page at `/` and the small JSON it reads besides the websocket.

    GET /                          static/index.html: per session a price chart and the
                                   standing answers, live over the websocket; an ask box
    GET /static/...                the page's JS/CSS, and vendored uPlot (static/vendor/uplot, MIT)
    GET /v1/sessions               your sessions: name, data_version, standing question ids
    GET /v1/sessions/{name}/bars   recent bar closes the session ingested (bars.py)

The JSON endpoints take `Authorization: Bearer` like the rest of the HTTP API.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from streamllm.service import protocol as p
from streamllm.service.httpauth import ApiError, JsonResponse, session_name, tenant_of

if TYPE_CHECKING:
    from streamllm.service.server import StreamServer

STATIC = Path(__file__).resolve().parent / "static"


def routes(server: StreamServer) -> list:
    engine = server.engine

    async def index(request: Request) -> Response:
        return FileResponse(STATIC / "index.html", media_type="text/html; charset=utf-8",
                            headers={"Cache-Control": "no-cache"})

    async def sessions(request: Request) -> Response:
        tenant = tenant_of(server, request)
        out = []
        for info in engine.list_sessions():
            local = tenant.local_name(info)
            if local is None or local.startswith("."):  # '.': a stateless request's temporary session
                continue
            questions = [{"id": q.id, "text": q.text, "choices": list(q.choices)}
                         for q in engine.standing_questions(info.name)]
            out.append({"name": local, "data_version": info.data_version, "lines_ingested": info.lines_ingested,
                        "questions": questions})
        return JsonResponse({"object": "list", "data": sorted(out, key=lambda s: s["name"])})

    async def bars(request: Request) -> Response:
        tenant = tenant_of(server, request)
        local = session_name(request.path_params["name"], "name")
        name = tenant.engine_name(local)
        try:
            info = engine.session_info(name)
        except KeyError:
            raise ApiError(404, f"no session named {local!r}; open it first", code=p.UNKNOWN_SESSION,
                           param="name") from None
        # serve --ray: feeds push inside the replicas, so the replica holding the session keeps its bars
        bar_closes = server.replicas.bar_closes if server.replicas is not None else server.bars.bars
        closes, seen = bar_closes(name)
        return JsonResponse({"session": local, "data_version": info.data_version, "bars_seen": seen,
                             "t": [t for t, _ in closes], "close": [c for _, c in closes]})

    return [Route("/", index, methods=["GET"]),
            Route("/v1/sessions", sessions, methods=["GET"]),
            Route("/v1/sessions/{name}/bars", bars, methods=["GET"]),
            Mount("/static", StaticFiles(directory=STATIC), name="static")]
