"""Bounds on the work one question may ask for, the same in config files, on the websocket and over HTTP.

A question costs tokenizing its text, prefilling it on top of a session and decoding up to
`max_tokens` tokens, with every stop string scanned after each decoded token, on the engine's
one core thread. These are the largest values anyone may ask for; `reader.py` (config files,
`register`) and the service (`ask`, `/v1/completions`) check them with the `*_problem` functions
below, so a value is refused the same way wherever it comes from. A value over a limit raises `LimitError`, a
`ConfigError` that the service reports as `too_large`.
"""

from __future__ import annotations

from typing import Any

from streamllm.config.specs import ConfigError

MAX_QUESTION_CHARS = 4096  # a question's text (standing or asked); ~1k tokens, a quarter of a default context
MAX_ASK_TOKENS = 512  # tokens one answer may decode (a standing question's max_tokens too)
MAX_STOPS = 4  # stop strings per ask (the OpenAI API's own limit)
MAX_STOP_CHARS = 64  # characters per stop string


class LimitError(ConfigError):
    """A value over one of the limits above: `key_path` names the field, `problem` the limit."""


def text_problem(text: str) -> str | None:
    """Why a question's text is over its limit, or None."""
    if len(text) > MAX_QUESTION_CHARS:
        return f"{len(text)} characters, over the limit of {MAX_QUESTION_CHARS}"
    return None


def max_tokens_problem(max_tokens: int) -> str | None:
    if max_tokens > MAX_ASK_TOKENS:
        return f"{max_tokens} tokens, over the limit of {MAX_ASK_TOKENS}"
    return None


def stops_problem(stops: list[Any]) -> str | None:
    """Why a list of stop strings is over its limits, or None (their types are the caller's check)."""
    if len(stops) > MAX_STOPS:
        return f"{len(stops)} stop strings, over the limit of {MAX_STOPS}"
    for index, stop in enumerate(stops):
        if isinstance(stop, str) and len(stop) > MAX_STOP_CHARS:
            return f"stop string {index} is {len(stop)} characters, over the limit of {MAX_STOP_CHARS}"
    return None
