"""The engine: the single writer (core) and what it owns; `Engine` is the public facade."""

from __future__ import annotations

from streamllm.engine.api import (
           AdmissionError,
           Engine,
           PushAck,
           SessionError,
           SessionInfo,
           decode_note,
)
from streamllm.engine.config import CompactionPolicy, EngineConfig, SchedulerConfig

__all__ = ["AdmissionError", "CompactionPolicy", "Engine", "EngineConfig", "PushAck", "SchedulerConfig", "SessionError",
           "SessionInfo", "decode_note"]
