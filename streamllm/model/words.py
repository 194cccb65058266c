"""The words of a data line a series head reads (engine/taps.py computes their features)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Word = int | str  # a word's index in its line, or a prefix: the line's first word that starts with it


def check_words(words: Sequence[Any]) -> tuple[Word, ...]:
    """Distinct word indices >= 0 and prefixes (non-empty, no whitespace); raises ValueError."""
    for w in words:
        ok = (isinstance(w, int) and not isinstance(w, bool) and w >= 0) or (
            isinstance(w, str) and w != "" and not any(c.isspace() for c in w))
        if not ok:
            raise ValueError(f"a word is an index >= 0 or a prefix without spaces, got {w!r} in {list(words)}")
    if len(set(words)) != len(words):
        raise ValueError(f"words must be distinct, got {list(words)}")
    return tuple(words)
