"""What the service's faces share (websocket, SSE, OpenAI): bearer tokens, restore-on-use, wire dicts."""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import Any


def bearer(scope: dict[str, Any]) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, or None without one."""
    for key, value in scope.get("headers", ()):
        if key == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


async def resident(engine: Any, name: str) -> None:
    """An evicted session is restored from its snapshot on first use: that reads the disk, so do
    it in a worker thread before asking, never inside submit_ask on the loop."""
    evicted = getattr(engine, "_evicted", None)
    if evicted and name in evicted:
        await asyncio.to_thread(engine._ensure_resident, name)


def info_dict(info: Any, local: str) -> dict[str, Any]:
    data = asdict(info)
    data["name"] = local
    return data


def standing_dict(answer: Any, local: str) -> dict[str, Any]:
    data = answer.to_dict()
    data["session"] = local
    return data
