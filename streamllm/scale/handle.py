"""The front door's view of one replica: its actor, its state and what it last answered."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class ReplicaState(StrEnum):
    STARTING = "starting"
    UP = "up"
    DOWN = "down"


@dataclass(slots=True, eq=False)
class ReplicaHandle:
    index: int
    actor: Any
    state: ReplicaState = ReplicaState.STARTING
    incarnation: str = ""
    info: dict[str, Any] = field(default_factory=dict)  # ready(): pid, node, model, recovery summary
    stats: dict[str, Any] = field(default_factory=dict)  # last stats() that answered
    sessions: list[Any] = field(default_factory=list)  # last list_sessions() that answered
    restarts: int = 0
    down_since: float | None = None
    last_down_reason: str = ""
    last_recovery_s: float | None = None
