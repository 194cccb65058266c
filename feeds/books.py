"""Local order books kept as the venues document: Binance's snapshot sync, and a book rebuilt from events.

Binance ("How to manage a local order book correctly", spot and USDⓈ-M/COIN-M futures):

    open the diff stream, buffer its events ─► take a REST snapshot (lastUpdateId L)
      ─► drop buffered events older than L     spot: u <= L      futures: u < L
      ─► the first event kept must span L      spot: U <= L+1 <= u   futures: U <= L <= u
      ─► then each event continues the last    spot: U == last u + 1   futures: pu == last u

A capture written that way holds depth events *before* its snapshot line, and the one that
spans the snapshot is often among them: it is applied, not counted as a gap. `DepthSync`
keeps the ids of the recent events (the buffer) so a snapshot can look back for its bridge.

A break in the chain before a symbol's first snapshot is counted at once (a live stream may
never see a snapshot, and a break there still means updates were lost), and taken back if
the snapshot then makes the events on both sides of it stale: the venue's procedure drops
them, so nothing the book needs was lost.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from feeds.events import BookDelta
from feeds.wire import ParseStats

KEEP = 4096  # events per symbol a snapshot can look back over (a capture snapshots within seconds)


class Step(Enum):
    """What the venue's procedure does with one depth event."""

    BUFFER = "buffer"  # no snapshot yet: held until one comes
    DROP = "drop"  # older than the snapshot
    APPLY = "apply"


@dataclass(slots=True)
class _Seen:
    first: int
    last: int
    payload: Any
    gap: tuple[str, int, int] | None = None  # the break counted between the event before and this one
    provisional: bool = False  # counted before any snapshot: taken back if the snapshot drops its side


@dataclass(slots=True)
class _Symbol:
    recent: deque[_Seen]
    last_u: int | None = None
    waiting: int | None = None  # a snapshot's lastUpdateId whose bridging event has not come yet
    synced: bool = False  # a snapshot has been bridged
    evicted_last: int | None = None  # `u` of the newest event pushed out of `recent`


class DepthSync:
    """Binance's documented sync, per symbol, on update ids only; breaks are counted in `stats`.

    `futures` selects the futures rule (`pu` chain, `U <= L <= u`); spot is `U == last u + 1`
    and `U <= L+1 <= u`. `update` is called for every depth event in arrival order, `snapshot`
    for every REST snapshot line; each returns what the book does with the events."""

    def __init__(self, futures: bool, stats: ParseStats | None = None, keep: int = KEEP) -> None:
        self.futures = futures
        self.stats = stats if stats is not None else ParseStats()
        self.keep = keep
        self._symbols: dict[str, _Symbol] = {}

    def _state(self, symbol: str) -> _Symbol:
        st = self._symbols.get(symbol)
        if st is None:
            st = self._symbols[symbol] = _Symbol(deque())
        return st

    def _stale(self, last: int, snap: int) -> bool:
        return last < snap if self.futures else last <= snap

    def _spans(self, first: int, snap: int) -> bool:
        return first <= (snap if self.futures else snap + 1)

    def synced(self, symbol: str) -> bool:
        st = self._symbols.get(symbol)
        return st is not None and st.synced

    def update(self, symbol: str, first: int, last: int, prev: int | None = None, payload: Any = None) -> Step:
        """One depth event (`U`, `u`, and `pu` on futures; `prev=None` skips the `pu` check)."""
        st = self._state(symbol)
        seen = _Seen(first, last, payload)
        key = symbol + "@depth"
        if st.waiting is not None:
            if self._stale(last, st.waiting):
                self._remember(st, seen)
                return Step.DROP
            if not self._spans(first, st.waiting):
                self._count(seen, key, st.waiting + (0 if self.futures else 1), first, provisional=False)
            st.waiting, st.synced = None, True
        elif st.last_u is not None:
            if not self.futures and last <= st.last_u:
                return Step.DROP  # spot: already covered (a resend); the chain stays where it was
            if self.futures and prev is not None and prev != st.last_u:
                self._count(seen, key + " pu", st.last_u, prev, provisional=not st.synced)
            elif not self.futures and first > st.last_u + 1:
                self._count(seen, key, st.last_u + 1, first, provisional=not st.synced)
        st.last_u = last
        self._remember(st, seen)
        return Step.APPLY if st.synced else Step.BUFFER

    def snapshot(self, symbol: str, last_update_id: int) -> list[Any]:
        """A snapshot (REST `lastUpdateId`): the payloads of the events received before it that the
        book applies on top of it, in order (the bridging event first); later events then say APPLY."""
        st = self._state(symbol)
        snap = last_update_id
        bridge: int | None = None
        for i, seen in enumerate(st.recent):
            if not self._stale(seen.last, snap):
                bridge = i
                break
        for i, seen in enumerate(st.recent):
            if seen.gap is not None and seen.provisional:
                seen.provisional = False
                if bridge is None or i <= bridge:  # the event before this one is dropped: nothing lost
                    self.stats.withdraw_gap(*seen.gap)
                    seen.gap = None
        if bridge is None:
            st.waiting, st.synced = snap, False
            return []
        first = st.recent[bridge]
        evicted_bridge = bridge == 0 and st.evicted_last is not None and not self._stale(st.evicted_last, snap)
        if not self._spans(first.first, snap) and not evicted_bridge:
            self._count(first, symbol + "@depth", snap + (0 if self.futures else 1), first.first, provisional=False)
        st.waiting, st.synced = None, True
        return [seen.payload for seen in list(st.recent)[bridge:]]

    def _count(self, seen: _Seen, where: str, expected: int, got: int, provisional: bool) -> None:
        self.stats.gap(where, expected, got)
        seen.gap, seen.provisional = (where, expected, got), provisional

    def _remember(self, st: _Symbol, seen: _Seen) -> None:
        if len(st.recent) >= self.keep:
            st.evicted_last = st.recent.popleft().last
        st.recent.append(seen)


@dataclass
class Book:
    """One instrument's book: price -> size per side, and whether a snapshot has set it."""

    bids: dict[float, float] = field(default_factory=dict)
    asks: dict[float, float] = field(default_factory=dict)
    snapshot_id: int | None = None  # the snapshot it was built from (its lastUpdateId, or 0 when none is given)
    applied: int = 0  # updates applied on top of the snapshot
    dropped: int = 0  # updates the rule drops: older than the snapshot (inline: before any snapshot)
    buffered: int = 0  # updates held for a snapshot not yet seen

    def apply(self, d: BookDelta) -> None:
        for side, levels in ((self.bids, d.bids), (self.asks, d.asks)):
            for price, size in levels:
                if size == 0:
                    side.pop(price, None)
                else:
                    side[price] = size

    def reset(self, d: BookDelta) -> None:
        self.bids, self.asks = {}, {}
        self.apply(d)
        self.snapshot_id = d.last_seq

    @property
    def best(self) -> tuple[float | None, float | None]:
        return max(self.bids, default=None), min(self.asks, default=None)


class LocalBooks:
    """Books rebuilt from a source's BookDeltas as a client keeps them. Binance's (`rule="spot"` or
    `"futures"`) follow `DepthSync`: updates before the snapshot are buffered and the one spanning it is
    applied. Other venues send their snapshot in the stream (`rule="inline"`): it starts the book, and
    updates before it cannot be applied. A book with no snapshot cannot be rebuilt (`books[i].snapshot_id`
    stays None); `sync.stats` counts the gaps the rule finds on ids alone (futures `pu` is not in a
    BookDelta: the parser checks that chain)."""

    def __init__(self, rule: str = "inline", keep: int = KEEP) -> None:
        if rule not in ("spot", "futures", "inline"):
            raise ValueError(f"book rule {rule!r}: one of spot, futures, inline")
        self.rule = rule
        self.books: dict[str, Book] = {}
        self.sync = DepthSync(futures=rule == "futures", keep=keep) if rule != "inline" else None

    @classmethod
    def for_venue(cls, venue: str, market: str = "spot") -> LocalBooks:
        return cls("inline" if venue != "binance" else "spot" if market == "spot" else "futures")

    def add(self, d: BookDelta) -> None:
        book = self.books.get(d.instrument)
        if book is None:
            book = self.books[d.instrument] = Book()
        if self.sync is None:
            if d.snapshot:
                book.reset(d)
            elif book.snapshot_id is None:
                book.dropped += 1
            else:
                book.apply(d)
                book.applied += 1
            return
        if d.snapshot:
            book.reset(d)
            held = self.sync.snapshot(d.instrument, d.last_seq)
            for buffered in held:
                book.apply(buffered)
            book.applied += len(held)
            book.dropped += max(0, book.buffered - len(held))
            book.buffered = 0
            return
        step = self.sync.update(d.instrument, d.first_seq, d.last_seq, payload=d)
        if step is Step.APPLY:
            book.apply(d)
            book.applied += 1
        elif step is Step.DROP:
            book.dropped += 1
        else:
            book.buffered += 1

    def extend(self, deltas: Iterable[BookDelta]) -> LocalBooks:
        for d in deltas:
            self.add(d)
        return self
