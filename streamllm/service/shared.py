"""What the service's faces share (websocket, SSE, OpenAI): bearer tokens, wire dicts."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any


def bearer(scope: dict[str, Any]) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, or None without one."""
    for key, value in scope.get("headers", ()):
        if key == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


def info_dict(info: Any, local: str) -> dict[str, Any]:
    data = asdict(info)
    data["name"] = local
    return data


def standing_dict(answer: Any, local: str) -> dict[str, Any]:
    data = answer.to_dict()
    data["session"] = local
    return data
