"""An order book kept as a client keeps it, to check parsers' BookDeltas against what venues say."""

from __future__ import annotations

from feeds.events import BookDelta

Book = tuple[dict[float, float], dict[float, float]]  # bids, asks: price -> size


def apply(books: dict[str, Book], d: BookDelta) -> Book:
    """`d` applied to its instrument's book in `books`: a snapshot starts it over, size 0 removes a level."""
    if d.snapshot or d.instrument not in books:
        books[d.instrument] = ({}, {})
    bids, asks = books[d.instrument]
    for side, levels in ((bids, d.bids), (asks, d.asks)):
        for price, size in levels:
            if size == 0:
                side.pop(price, None)
            else:
                side[price] = size
    return bids, asks
