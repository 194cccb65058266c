"""The engine: the single writer (core) and what it owns; `Engine` is the public facade."""

from __future__ import annotations

from streamllm.engine.api import AdmissionError, Engine, PushAck, SessionError, SessionInfo

__all__ = ["AdmissionError", "Engine", "PushAck", "SessionError", "SessionInfo"]
