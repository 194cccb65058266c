"""The one error the front door adds: a session's replica is down or recovering (no Ray import here)."""

from __future__ import annotations


class ReplicaUnavailable(RuntimeError):
    """The replica holding the session is dead, restarting or recovering its sessions (or the session is
    being moved). Nothing acked is lost: retry after a moment. The service answers `unavailable`."""

    def __init__(self, message: str, *, replica: int | None = None) -> None:
        super().__init__(message)
        self.replica = replica
