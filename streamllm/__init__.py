"""streamllm: streaming market-data analytics on stateful transformer sessions.

The engine (torch, transformers) is imported on first use, so the thin client
(`streamllm.client`, `streamllm ask`, `streamllm watch`) starts without them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["AdmissionError", "Answer", "Engine", "PushAck", "SessionError", "SessionInfo"]

if TYPE_CHECKING:
    from streamllm.engine.api import AdmissionError, Engine, PushAck, SessionError, SessionInfo
    from streamllm.engine.outputs import Answer


def __getattr__(name: str) -> Any:
    if name == "Answer":
        from streamllm.engine.outputs import Answer

        return Answer
    if name in __all__:
        from streamllm.engine import api

        return getattr(api, name)
    raise AttributeError(f"module 'streamllm' has no attribute {name!r}")
