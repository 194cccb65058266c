"""Per-line features of a session: what a series head reads (streamllm/model/adapter.py).

A series head answers from the session's recent data lines, not from one decision
point. For each data line it takes the residual stream at one layer (the runner's
tap_layer) and keeps [mean over the line's tokens, the line's last token], then the
last token of each chosen word (`words`: an index of a whitespace-separated word, or a
prefix: the line's first word that starts with it, as `v` finds a bar's volume wherever
the optional o/h/l fields put it). A word's last token is where a number written digit
by digit is whole: the model's state there holds its value far better than a mean over
the line does. The session's own ingest computes those rows anyway, so a line's features
cost a sum; the last `keep` lines are kept, numbered from the session's first line.

    session  [prefix | line 0 | line 1 | ... | line k (computing)]
    line     23:02 46411 +34 h+5 ...        words 0, 1, 2, ...; a word starts at a token that
             ^^^^^ ^^^^^^ ^^^              starts with whitespace (the tokenizer's table)
    features f = [mean, last, word w1's last token, ...]   (2 + len(words)) x H, once the line is whole

A word ends where the next one (or the line's newline) starts; a line without a chosen
word (too few words, no word with the prefix) gets zeros there. `tune` extracts its
training features with this same class on the same forward, so training and serving
read identical numbers (tests/test_series.py).

Beside the model's features a line also has its own numbers (`line_numbers`, from the pushed
text, no model): what a learned head and its control read (engine/standing/learning.py), to say
what the model's states add over the raw numbers of the same lines. They are computed and kept
only while some standing question of the session reads them (`read_numbers`): lines pushed
before that have none (a learner's training set reads zeros there).
"""

from __future__ import annotations

import math
import re
from bisect import bisect_right
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from streamllm.model.words import Word, check_words

WHITESPACE_MARKS = ("Ġ", "Ċ", "ĉ", "▁")  # byte-level BPE's space, newline, tab; SentencePiece's space


# A line's numbers: a word that is a number, bare or after a letter prefix (`46411`, `+34`, `h+5`, `v1.5e3`).
# Bare ones fill the first NUMBER_POSITIONS slots in order (a bar's close, its change), prefixed ones one
# slot per letter (its first use), so optional fields (o/h/l only when they differ) never shift the others.
NUMBER_POSITIONS = 4
NUMBER_WIDTH = NUMBER_POSITIONS + 26
_NUMBER_WORD = re.compile(r"([A-Za-z]?)([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)%?")


def line_numbers(line: str) -> tuple[float, ...]:
    """The numbers a line writes, NUMBER_WIDTH of them (0 where absent): a head's raw-number control."""
    out = [0.0] * NUMBER_WIDTH
    bare = 0
    for word in line.split():
        m = _NUMBER_WORD.fullmatch(word)
        if m is None:
            continue  # a time (23:02), a symbol, a word
        value = float(m.group(2))
        if not math.isfinite(value):
            continue
        letter = m.group(1).lower()
        if letter:
            slot = NUMBER_POSITIONS + ord(letter) - ord("a")
            if out[slot] == 0.0:
                out[slot] = value
        elif bare < NUMBER_POSITIONS:
            out[bare] = value
            bare += 1
    return tuple(out)


def _tokens(tokenizer: Any) -> list[Any]:
    return tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))


def _starts(tokens: list[Any]) -> frozenset[int]:
    """Ids of the tokens that start with whitespace: each starts a new word of a line."""
    return frozenset(i for i, t in enumerate(tokens)
                     if isinstance(t, str) and t and (t[0] in WHITESPACE_MARKS or t[0].isspace()))


def _texts(tokens: list[Any]) -> tuple[str, ...]:
    """Each token's text without leading whitespace (marks included): what a prefix word is matched on.
    Byte-level BPE spells ASCII as itself, so an ASCII prefix matches as written."""
    return tuple(t.lstrip("".join(WHITESPACE_MARKS)).lstrip() if isinstance(t, str) else "" for t in tokens)


def word_tables(tokenizer: Any, words: Sequence[Word]) -> tuple[frozenset[int], tuple[str, ...] | None]:
    """What LineTaps needs of the tokenizer for `words`: the word-start ids, and token texts when a
    word is chosen by prefix (one walk over the vocabulary: ~0.1 s for 49k tokens)."""
    if not words:
        return frozenset(), None
    tokens = _tokens(tokenizer)
    return _starts(tokens), _texts(tokens) if any(isinstance(w, str) for w in words) else None


class LineTaps:
    __slots__ = ("keep", "words", "word_starts", "texts", "lines", "numbers", "_line", "_sum", "_count", "_word",
                 "_marks", "_prev", "_text", "_need", "reading_numbers")

    def __init__(self, keep: int, words: Sequence[Word] = (), word_starts: frozenset[int] = frozenset(),
                 texts: Sequence[str] | None = None) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.words = check_words(words)
        if words and not word_starts:
            raise ValueError("word features need the tokenizer's word-start ids")
        prefixes = [w for w in self.words if isinstance(w, str)]
        if prefixes and texts is None:
            raise ValueError(f"prefix words {prefixes} need the tokenizer's token texts")
        self.keep = keep
        self.word_starts = word_starts
        self.texts = texts if prefixes else None
        self._need = max(map(len, prefixes), default=0)  # the characters of a word a prefix can look at
        self._text = ""  # the start of the word the line's newest token belongs to (up to _need characters)
        self.lines: deque[tuple[int, torch.Tensor]] = deque(maxlen=keep)  # (line index, [(2 + W) H])
        self.numbers: dict[int, tuple[float, ...]] = {}  # line index -> its own numbers (`line_numbers`), newest keep
        self.reading_numbers = False  # whether a standing question reads them: only then are they kept
        self._line = -1  # index of the line being summed
        self._sum: torch.Tensor | None = None
        self._count = 0
        self._word = 0  # the word the line's newest token belongs to
        self._marks: dict[Word, torch.Tensor] = {}  # chosen word -> its last token's row
        self._prev: torch.Tensor | None = None  # the row of the token before this chunk (a word may end there)

    def add(self, rows: torch.Tensor, start: int, ids: Sequence[int], line_ends: Sequence[int],
            lines_before: int, prefix_len: int) -> None:
        """Fold in the tapped rows [n, H] of session tokens [start, start + n) with their ids.

        line_ends: the token index after each line the session holds (ascending); lines_before:
        the index of the line ending at line_ends[0] (lines cut away by compaction before it)."""
        end = start + rows.shape[0]
        if len(ids) != rows.shape[0]:
            raise ValueError(f"{len(ids)} token ids for {rows.shape[0]} tapped rows")
        pos = max(start, prefix_len)  # the system prompt is no line
        k = bisect_right(line_ends, pos)  # the line holding token pos ends at line_ends[k]
        while pos < end:
            if k >= len(line_ends):
                raise ValueError(f"token {pos} lies past the last line end {line_ends[-1] if line_ends else None}")
            line = lines_before + k
            stop = min(end, line_ends[k])
            line_start = line_ends[k - 1] if k else prefix_len
            if line != self._line:  # a new line; met mid-way (after a restore) it cannot be summed whole
                whole = pos == line_start
                self._line, self._sum, self._count = line, None, 0 if whole else -1
                self._word, self._marks, self._text = 0, {}, ""
            if self._count >= 0:
                part = rows[pos - start: stop - start].sum(0)
                self._sum = part if self._sum is None else self._sum + part
                self._count += stop - pos
                if self.words:
                    self._mark_words(rows, start, ids, pos, stop, line_start)
            if stop == line_ends[k]:
                if self._count > 0:
                    last = rows[stop - 1 - start]
                    zero = torch.zeros_like(last)
                    self.lines.append((line, torch.cat([self._sum / self._count, last]
                                                       + [self._marks.get(w, zero) for w in self.words])))
                self._line, self._sum, self._count = -1, None, 0
            pos = stop
            k += 1
        self._prev = rows[-1] if rows.shape[0] else self._prev

    def _mark_words(self, rows: torch.Tensor, start: int, ids: Sequence[int], pos: int, stop: int,
                    line_start: int) -> None:
        texts = self.texts
        for t in range(pos, stop):
            tid = ids[t - start]
            if t == line_start or tid not in self.word_starts:
                if texts is not None and len(self._text) < self._need:  # the word goes on: so does its text
                    self._text += texts[tid]
                continue
            # token t starts the next word: t - 1 ended this one
            ended = rows[t - 1 - start] if t > start else self._prev
            if self._word in self.words:
                self._marks[self._word] = ended
            if texts is not None:
                for w in self.words:
                    if isinstance(w, str) and w not in self._marks and self._text.startswith(w):
                        self._marks[w] = ended
                self._text = texts[tid]
            self._word += 1

    def keep_at_least(self, keep: int) -> None:
        """Keep the newest `keep` lines from now on if that is more than now (a question that reads more
        lines registered); what is held stays."""
        if keep > self.keep:
            self.keep = keep
            self.lines = deque(self.lines, maxlen=keep)

    def read_numbers(self, on: bool) -> None:
        """Keep the numbers of lines pushed from now on (`note_lines`) while `on`; off forgets those kept."""
        self.reading_numbers = on
        if not on:
            self.numbers.clear()

    def note_lines(self, first_line: int, lines: Sequence[str]) -> None:
        """The pushed lines first_line, first_line + 1, ...: their numbers are kept (the newest `keep`)
        while a question reads them, else not even computed."""
        if not self.reading_numbers:
            return
        skip = max(0, len(lines) - self.keep)  # a batch longer than `keep`: only its newest lines stay
        for i in range(skip, len(lines)):
            self.numbers[first_line + i] = line_numbers(lines[i])
        while len(self.numbers) > self.keep:
            del self.numbers[next(iter(self.numbers))]

    def numbers_window(self, upto: int, count: int, fill: bool = False) -> torch.Tensor | None:
        """[count, NUMBER_WIDTH]: the numbers of lines upto-count .. upto-1; None unless all are held
        (fill: zeros for a line not held, as a learner's training set reads it)."""
        missing = (0.0,) * NUMBER_WIDTH if fill else None
        rows = [self.numbers.get(n, missing) for n in range(upto - count, upto)]
        if count < 1 or any(r is None for r in rows):
            return None
        return torch.tensor(rows, dtype=torch.float32)

    def window(self, upto: int, count: int) -> torch.Tensor | None:
        """Features [count, (2 + W) H] of lines upto-count .. upto-1 (oldest first); None unless all are held."""
        span = self._span(upto, count)
        return None if span is None else torch.stack([self.lines[i][1] for i in range(*span)])

    def holds(self, upto: int, count: int) -> bool:
        """Whether `window(upto, count)` would be whole, without building it."""
        return self._span(upto, count) is not None

    def _span(self, upto: int, count: int) -> tuple[int, int] | None:
        """Indices [first, last + 1) into `lines` of lines upto-count .. upto-1; None unless all are held."""
        if count > len(self.lines) or count < 1:
            return None
        newest = len(self.lines) - 1
        while newest >= 0 and self.lines[newest][0] >= upto:  # lines computed after the decision point
            newest -= 1
        first = newest - count + 1
        if first < 0 or self.lines[newest][0] != upto - 1 or self.lines[first][0] != upto - count:
            return None  # too few, or a gap (a restore, a skipped line)
        return first, newest + 1

    @property
    def num_lines(self) -> int:
        """Index after the newest line held (0: none)."""
        return self.lines[-1][0] + 1 if self.lines else 0


LINE_SLACK = 64  # lines kept beyond a series head's window (entries lag ingest)


@dataclass(frozen=True, slots=True)
class TapConfig:
    """What line features every session keeps for the adapter's series heads (lines 0: none)."""

    lines: int = 0  # lines of features each session keeps
    words: tuple[Word, ...] = ()  # the words whose last token each line's features add
    word_starts: frozenset[int] = frozenset()  # the tokenizer's word-start ids (with words)
    word_texts: tuple[str, ...] | None = None  # its token texts (with prefix words)

    @classmethod
    def for_heads(cls, tokenizer: Any, lines: int, words: Sequence[Word]) -> TapConfig:
        """Keep `lines` lines of `words` (no lines: nothing served)."""
        if not lines:
            return cls()
        if not words:
            return cls(lines)
        starts, texts = word_tables(tokenizer, words)
        return cls(lines, tuple(words), starts, texts)

    def new_taps(self) -> LineTaps | None:
        """A session's line features (None when no series head is served)."""
        return LineTaps(self.lines, self.words, self.word_starts, self.word_texts) if self.lines else None
