"""The service's wire protocol: message decoding, field validation and error codes.

Every message is one JSON object `{"type": ..., "id": ..., ...}`. Validation raises
`ProtocolError(code, message)`; the server turns it into an `error` reply that echoes
the request's `id`, and the connection carries on. See docs/protocol.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

from streamllm.config import limits

# Stable error codes: clients may branch on these, so never rename one.
BAD_JSON = "bad_json"
UNKNOWN_TYPE = "unknown_type"
BAD_FIELD = "bad_field"
TOO_LARGE = "too_large"
UNKNOWN_SESSION = "unknown_session"
SESSION_EXISTS = "session_exists"
UNKNOWN_QUESTION = "unknown_question"
UNAUTHORIZED = "unauthorized"
FORBIDDEN = "forbidden"
CAPACITY = "capacity"
BUSY = "busy"
QUOTA = "quota"
CONFIG_ERROR = "config_error"
INTERNAL = "internal"
UNAVAILABLE = "unavailable"  # the session's replica is restarting (serve --ray); retry shortly
TIMEOUT = "timeout"  # the question ran past the engine's ask deadline; nothing of it is left running
ERROR_CODES = (BAD_JSON, UNKNOWN_TYPE, BAD_FIELD, TOO_LARGE, UNKNOWN_SESSION, SESSION_EXISTS,
               UNKNOWN_QUESTION, UNAUTHORIZED, FORBIDDEN, CAPACITY, BUSY, QUOTA, CONFIG_ERROR, INTERNAL, UNAVAILABLE,
               TIMEOUT)

CLIENT_TYPES = ("hello", "open", "close", "push", "register", "unregister", "ask", "subscribe",
                "unsubscribe", "stats")
# Types that change a session: a read-only tenant gets `forbidden` for these.
WRITE_TYPES = frozenset({"open", "close", "push", "register", "unregister"})

SESSION_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
MAX_ID_CHARS = 128
MAX_LINES_PER_PUSH = 10_000
# What one question may ask for: one set of numbers, shared with config files (parse_question) and HTTP.
MAX_QUESTION_CHARS = limits.MAX_QUESTION_CHARS
MAX_ASK_TOKENS = limits.MAX_ASK_TOKENS
MAX_STOPS = limits.MAX_STOPS
MAX_STOP_CHARS = limits.MAX_STOP_CHARS


class ProtocolError(Exception):
    """A request the server refuses; `code` is one of ERROR_CODES."""

    def __init__(self, code: str, message: str, request_id: str | int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id  # set when the id was readable before the message failed


@dataclass(slots=True)
class Request:
    type: str
    id: str | int | None
    body: dict[str, Any]

    def field(self, key: str, kinds: type | tuple[type, ...], what: str, default: Any = ...) -> Any:
        """`body[key]`, type-checked; a missing or mistyped field names itself in the error."""
        if key not in self.body:
            if default is ...:
                raise ProtocolError(BAD_FIELD, f"{self.type}: missing field {key!r} ({what})")
            return default
        value = self.body[key]
        # JSON booleans are ints to Python: never accept one where a number is meant.
        if not isinstance(value, kinds) or (isinstance(value, bool) and not _allows_bool(kinds)):
            raise ProtocolError(BAD_FIELD, f"{self.type}: field {key!r} must be {what}, got {_kind(value)}")
        return value

    def session(self) -> str:
        name = self.field("session", str, "a session name")
        if not SESSION_NAME.match(name):
            raise ProtocolError(BAD_FIELD, f"{self.type}: session name {name!r} must be 1-64 letters, "
                                           "digits, '_', '.' or '-', starting with a letter or digit")
        return name

    def text(self, key: str, what: str) -> str:
        value = self.field(key, str, what)
        if not value.strip():
            raise ProtocolError(BAD_FIELD, f"{self.type}: field {key!r} must not be empty")
        return value

    def integer(self, key: str, default: int | None, low: int, high: int) -> int | None:
        value = self.field(key, int, f"an integer in [{low}, {high}]", default)
        if value is not None and not low <= value <= high:
            raise ProtocolError(BAD_FIELD, f"{self.type}: field {key!r} must be in [{low}, {high}], got {value}")
        return value

    def flag(self, key: str, default: bool) -> bool:
        return self.field(key, bool, "true or false", default)

    def within(self, key: str, problem: str | None) -> None:
        """`too_large` naming the field, when `problem` (a config/limits.py check) says it is over a limit."""
        if problem is not None:
            raise ProtocolError(TOO_LARGE, f"{self.type}: field {key!r}: {problem}")

    def question(self) -> tuple[str, int | None, list[str] | None]:
        """An ask's `question`, `max_tokens` and `stop`, each checked against config/limits.py."""
        question = self.text("question", "the question text, or a standing question's id")
        self.within("question", limits.text_problem(question))
        max_tokens = self.field("max_tokens", int, f"an integer in [1, {MAX_ASK_TOKENS}]", None)
        if max_tokens is not None:  # None: the standing question's, or 16
            if max_tokens < 1:
                raise ProtocolError(BAD_FIELD, f"{self.type}: field 'max_tokens' must be at least 1, got {max_tokens}")
            self.within("max_tokens", limits.max_tokens_problem(max_tokens))
        stop = self.field("stop", list, "an array of strings", None)
        if stop is not None:
            self.within("stop", limits.stops_problem(stop))
            if not all(isinstance(s, str) and s for s in stop):
                raise ProtocolError(BAD_FIELD, f"{self.type}: field 'stop' must hold non-empty strings")
        return question, max_tokens, stop


def decode(raw: str | bytes, max_bytes: int) -> Request:
    """Parse one incoming frame; ProtocolError for anything but a typed JSON object."""
    size = len(raw.encode() if isinstance(raw, str) else raw)
    if size > max_bytes:
        raise ProtocolError(TOO_LARGE, f"message is {size} bytes, over the limit of {max_bytes}", peek_id(raw))
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(BAD_JSON, f"not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ProtocolError(BAD_JSON, f"a message must be a JSON object, got {_kind(data)}")
    req_id = data.get("id")
    if req_id is not None and (isinstance(req_id, bool) or not isinstance(req_id, str | int)
                               or (isinstance(req_id, str) and len(req_id) > MAX_ID_CHARS)):
        raise ProtocolError(BAD_FIELD, f"field 'id' must be a string (up to {MAX_ID_CHARS} chars) or an integer")
    kind = data.get("type")
    if not isinstance(kind, str):
        raise ProtocolError(BAD_FIELD, "missing field 'type' (a string: " + ", ".join(CLIENT_TYPES) + ")", req_id)
    if kind not in CLIENT_TYPES:
        raise ProtocolError(UNKNOWN_TYPE, f"unknown message type {kind!r}; use one of " + ", ".join(CLIENT_TYPES),
                            req_id)
    return Request(kind, req_id, data)


PEEK_BYTES = 4096  # how far into a message too large to parse `peek_id` looks for its id
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_COLON = re.compile(r"\s*:\s*")
_ID_VALUE = re.compile(r'-?\d{1,19}(?![\d.eE])|"(?:[^"\\]|\\.)*"')


def peek_id(raw: str | bytes, head: int = PEEK_BYTES) -> str | int | None:
    """The top-level `"id"` of a message refused unparsed (too large), when its first `head` bytes hold
    one that `decode` would accept; None otherwise. Reads only that head, so the refusal stays cheap: a
    key inside a nested object or a string is not the message's id."""
    text = raw[:head] if isinstance(raw, str) else raw[:head].decode("utf-8", "replace")
    depth, i = 0, 0
    while i < len(text):
        c = text[i]
        if c == '"':
            string = _JSON_STRING.match(text, i)
            if string is None:
                return None  # cut inside a string: the id is not in the head
            i = string.end()
            colon = _COLON.match(text, i)
            if depth == 1 and colon is not None and string.group() == '"id"':
                value = _ID_VALUE.match(text, colon.end())
                if value is None:
                    return None
                req_id = orjson.loads(value.group())
                return req_id if not isinstance(req_id, str) or len(req_id) <= MAX_ID_CHARS else None
            continue
        if c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
        i += 1
    return None


def encode(message: dict[str, Any]) -> bytes:
    return orjson.dumps(message, option=orjson.OPT_SERIALIZE_NUMPY)


def error(code: str, message: str, req_id: str | int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "error", "code": code, "message": message}
    if req_id is not None:
        out["id"] = req_id
    return out


def _allows_bool(kinds: type | tuple[type, ...]) -> bool:
    return bool in (kinds if isinstance(kinds, tuple) else (kinds,))


def _kind(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)
