"""streamllm: streaming market-data analytics on stateful transformer sessions."""

from __future__ import annotations

from streamllm.engine import AdmissionError, Engine, PushAck, SessionError, SessionInfo
from streamllm.session import Answer

__all__ = ["AdmissionError", "Answer", "Engine", "PushAck", "SessionError", "SessionInfo"]
