"""Per-line features of a session: what a series head reads (streamllm/model/adapter.py).

A series head answers from the session's recent data lines, not from one decision
point: for each data line it takes the residual stream at one layer (the runner's
tap_layer) over that line's tokens and keeps [mean over the line, last token] (2H
floats). The session's own ingest computes those rows anyway, so a line's features
cost a sum; the last `keep` lines are kept, numbered from the session's first line.

    session  [prefix | line 0 | line 1 | ... | line k (computing)]
    features           f0       f1             fk = [mean, last] once line k's last token is computed

`tune` extracts its training features with this same class on the same forward, so
training and serving read identical numbers (tests/test_series.py).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Sequence

import torch


class LineTaps:
    __slots__ = ("keep", "lines", "_line", "_sum", "_count")

    def __init__(self, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self.lines: deque[tuple[int, torch.Tensor]] = deque(maxlen=keep)  # (line index, [2H])
        self._line = -1  # index of the line being summed
        self._sum: torch.Tensor | None = None
        self._count = 0

    def add(self, rows: torch.Tensor, start: int, line_ends: Sequence[int], lines_before: int, prefix_len: int) -> None:
        """Fold in the tapped rows [n, H] of session tokens [start, start + n).

        line_ends: the token index after each line the session holds (ascending); lines_before:
        the index of the line ending at line_ends[0] (lines cut away by compaction before it)."""
        end = start + rows.shape[0]
        pos = max(start, prefix_len)  # the system prompt is no line
        k = bisect_right(line_ends, pos)  # the line holding token pos ends at line_ends[k]
        while pos < end:
            if k >= len(line_ends):
                raise ValueError(f"token {pos} lies past the last line end {line_ends[-1] if line_ends else None}")
            line = lines_before + k
            stop = min(end, line_ends[k])
            if line != self._line:  # a new line; met mid-way (after a restore) it cannot be summed whole
                whole = pos == (line_ends[k - 1] if k else prefix_len)
                self._line, self._sum, self._count = line, None, 0 if whole else -1
            if self._count >= 0:
                part = rows[pos - start: stop - start].sum(0)
                self._sum = part if self._sum is None else self._sum + part
                self._count += stop - pos
            if stop == line_ends[k]:
                if self._count > 0:
                    self.lines.append((line, torch.cat([self._sum / self._count, rows[stop - 1 - start]])))
                self._line, self._sum, self._count = -1, None, 0
            pos = stop
            k += 1

    def window(self, upto: int, count: int) -> torch.Tensor | None:
        """Features [count, 2H] of lines upto-count .. upto-1 (oldest first); None unless all are held."""
        if count > len(self.lines) or count < 1:
            return None
        newest = len(self.lines) - 1
        while newest >= 0 and self.lines[newest][0] >= upto:  # lines computed after the decision point
            newest -= 1
        first = newest - count + 1
        if first < 0 or self.lines[newest][0] != upto - 1 or self.lines[first][0] != upto - count:
            return None  # too few, or a gap (a restore, a skipped line)
        return torch.stack([self.lines[i][1] for i in range(first, newest + 1)])

    @property
    def num_lines(self) -> int:
        """Index after the newest line held (0: none)."""
        return self.lines[-1][0] + 1 if self.lines else 0
