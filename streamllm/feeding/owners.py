"""Which sessions a feed owns, and whether clients may push into them beside it.

A session a config gives a feed is the feed's: a client `push` into it is refused
(`forbidden`) unless the session's config says `client_pushes = true`, so a stray line cannot
draw into the feed's chart or its questions' data. Sessions no feed owns (those clients open)
take pushes as before. `serve` builds the map once from the config; the websocket reads it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from streamllm.config import QueryConfig


@dataclass(frozen=True, slots=True)
class FeedOwner:
    session: str  # as the config names it
    feed: str  # the feed as /health names it (`binance`, `replay:/data/x.csv`)
    client_pushes: bool  # the config's `client_pushes`
    changes: str  # the unit of its bar lines' changes (feeding/render.py): "price" or "bp"
    where: str  # the config file and the session's key, for messages

    def refusal(self) -> str:
        """Why a client's push into this session is refused (the websocket's `forbidden` message)."""
        return (f"push: session {self.session!r} is fed by feed {self.feed!r}; client pushes into it are refused "
                f"unless its config allows them ({self.where}.client_pushes = true)")


def feed_owners(config: QueryConfig, groups: Iterable[Any], owner: Any) -> dict[str, FeedOwner]:
    """{engine session name: its FeedOwner} for every config session a feed group runs.
    groups: feeding/wiring.py's FeedGroups (the feed each session actually gets, `--feed` included);
    owner: the tenant owning the config's sessions (its engine_name)."""
    index = {spec.name: i for i, spec in enumerate(config.sessions)}
    out = {}
    for group in groups:
        for spec in group.sessions:
            where = f"{config.source}: {spec.block or f'sessions[{index[spec.name]}]'}"
            out[owner.engine_name(spec.name)] = FeedOwner(spec.name, str(group.feed), spec.client_pushes,
                                                          spec.render.changes, where)
    return out
