"""Engine exceptions -> the service's stable error codes, shared by the websocket and HTTP faces."""

from __future__ import annotations

import logging
import re

from streamllm.config import ConfigError
from streamllm.config.limits import LimitError
from streamllm.durability.ingest_log import IngestLogError
from streamllm.engine import AdmissionError, SessionError
from streamllm.engine.kv import KVCapacityError
from streamllm.engine.outputs import AskTimeout, ReplicaUnavailable
from streamllm.service import protocol as p
from streamllm.service.quotas import QuotaExceeded

log = logging.getLogger("streamllm.service.server")
_ENGINE_NAME = re.compile(r"'[A-Za-z0-9][A-Za-z0-9_.-]{0,63}/([A-Za-z0-9.][A-Za-z0-9_.-]{0,63})'")


def engine_error(exc: BaseException, kind: str) -> tuple[str, str]:
    """(code, message) for an exception raised by the engine or by validation."""
    if isinstance(exc, QuotaExceeded):
        return p.QUOTA, str(exc)
    if isinstance(exc, AskTimeout):  # past the engine's ask deadline: dropped, its cells freed (HTTP 504)
        return p.TIMEOUT, client_text(str(exc))
    if isinstance(exc, ReplicaUnavailable):  # serve --ray: the session's replica is recovering
        return p.UNAVAILABLE, client_text(str(exc))
    if isinstance(exc, IngestLogError):  # the disk failed: not acked, nothing kept (durability/ingest_log.py)
        return p.UNAVAILABLE, client_text(str(exc))
    if isinstance(exc, SessionError):
        return p.UNKNOWN_SESSION, client_text(str(exc))
    if isinstance(exc, AdmissionError | KVCapacityError):
        return p.CAPACITY, client_text(str(exc))
    if isinstance(exc, LimitError):  # a registered question over config/limits.py's bounds
        return p.TOO_LARGE, str(exc)
    if isinstance(exc, ConfigError):
        return p.CONFIG_ERROR, str(exc)
    if isinstance(exc, KeyError):  # e.g. unregister of an unknown question id
        return p.UNKNOWN_QUESTION, client_text(str(exc.args[0] if exc.args else exc))
    if isinstance(exc, ValueError | TypeError):
        return p.BAD_FIELD, f"{kind}: {client_text(str(exc))}"
    log.exception("%s failed", kind, exc_info=exc)
    return p.INTERNAL, f"{kind}: internal error ({type(exc).__name__}); the server logged it"


def client_text(text: str) -> str:
    """Engine messages quote engine names ('alice/btc'); a client knows its sessions as 'btc'."""
    return _ENGINE_NAME.sub(r"'\1'", text)
