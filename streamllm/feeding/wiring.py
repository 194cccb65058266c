"""How a config's feeds become events and attachments: shared by `serve` and each `serve --ray` replica.

    config sessions --group_feeds--> FeedGroup (one source: a synthetic market, a venue connection,
                                      recorded files) --feed_events--> paced events
                                                     --build_attachments--> one Attachment per session

A live venue group carries every symbol its sessions need (a template's hundreds included) on as
few connections as the venue allows, demultiplexed to each symbol's session by instrument
(feeding/attach.py); recorded feeds are replayable, so their batches carry their position and a
restart resumes after the ingest log's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from feeds.adapters import FeedAdapter, channels_for, connection_shards
from feeds.cryptofeed_adapter import CryptofeedAdapter
from feeds.replay import amerge, apaced, merge
from feeds.sources import ReadOptions, open_recorded
from feeds.synthetic import SyntheticFeed
from streamllm.config import (
    LIVE_VENUES,
    FeedSpec,
    QueryConfig,
    SessionSpec,
    is_websocket_url,
    venue_symbol,
)
from streamllm.durability.ingest_log import IngestLog
from streamllm.engine.client import EngineClient
from streamllm.feeding.attach import Attachment, AttachSpec

log = logging.getLogger("streamllm.feeding.wiring")


class Owner(Protocol):
    """Who owns the config's sessions (service.tenants.Tenant): it names them in the engine."""

    @property
    def name(self) -> str: ...  # the tenant, told to the engine at open

    def engine_name(self, name: str) -> str: ...


@dataclass(slots=True)
class FeedGroup:
    """Sessions fed from one source (one synthetic market, one venue connection, one replay)."""

    feed: FeedSpec
    sessions: list[SessionSpec] = field(default_factory=list)
    read: Any = None  # feeds.sources.ReadOptions for recorded files (--columns, --tz, ...)


def parse_feed_override(text: str) -> FeedSpec:
    kind, _, rest = text.partition(":")
    if kind == "synthetic" and not rest:
        return FeedSpec("synthetic")
    if kind in LIVE_VENUES and (not rest or is_websocket_url(rest.strip())):
        return FeedSpec(kind, url=rest.strip())
    if kind in ("replay", "csv") and rest.strip():
        return FeedSpec(kind, Path(rest.strip()))  # comma-separated files allowed: split at open
    if kind == "cryptofeed" and rest.strip():
        return FeedSpec(kind, None, (), rest.strip().upper())
    raise ValueError(f"--feed {text!r}: use synthetic, a venue ({', '.join(LIVE_VENUES)}; VENUE:wss://... for "
                     "another endpoint), replay:FILE[,FILE...], csv:FILE or cryptofeed:EXCHANGE")


def venue_credentials(venue: str) -> dict[str, str]:
    """Alpaca's keys from the environment variables its own SDKs read; other venues' market data is public."""
    if venue != "alpaca":
        return {}
    key, secret = os.environ.get("APCA_API_KEY_ID", ""), os.environ.get("APCA_API_SECRET_KEY", "")
    if not key or not secret:
        raise ValueError("feed 'alpaca' needs your Alpaca keys in APCA_API_KEY_ID and APCA_API_SECRET_KEY")
    return {"key": key, "secret": secret}


def group_feeds(config: QueryConfig, override: FeedSpec | None) -> list[FeedGroup]:
    groups: dict[str, FeedGroup] = {}
    for spec in config.sessions:
        feed = override or spec.feed
        key = str(feed)  # one source per feed: a venue connection carries all its sessions' symbols
        groups.setdefault(key, FeedGroup(feed)).sessions.append(spec)
    return list(groups.values())


def feed_file_problems(groups: list[FeedGroup], config: QueryConfig, override: FeedSpec | None = None) -> list[str]:
    """One line per replay/csv file a feed names that cannot be read (missing, a folder, no permission),
    naming the config key (or `--feed`) and the file: `serve` checks them before it loads a model."""
    problems = []
    for group in groups:
        if group.feed.kind not in ("replay", "csv") or group.feed.path is None:
            continue
        first = group.sessions[0]
        where = "--feed" if override is not None else \
            f"{config.source}: {first.block or f'sessions[{config.sessions.index(first)}]'}.feed"
        for name in str(group.feed.path).split(","):
            path = Path(name.strip()).expanduser()
            try:
                with path.open("rb") as file:
                    file.read(1)
            except IsADirectoryError:
                problems.append(f"{where}: {group.feed.kind} file {path}: is a folder, not a file")
            except FileNotFoundError:
                problems.append(f"{where}: {group.feed.kind} file {path}: no such file")
            except OSError as exc:
                problems.append(f"{where}: {group.feed.kind} file {path}: cannot read it ({exc.strerror or exc})")
    return problems


def feed_events(group: FeedGroup, speed: float | None, seed: int) -> AsyncIterator[Any]:
    """The group's events as an async stream, in receive order and paced."""
    feed = group.feed
    if feed.kind == "synthetic":
        return SyntheticFeed(seed=seed).aevents(speed=speed)
    if feed.kind in LIVE_VENUES:
        return amerge(*(adapter.events() for adapter in venue_adapters(group)))
    if feed.kind == "cryptofeed":
        symbols = []
        for spec in group.sessions:
            symbols += [s for s in (spec.feed.symbols or (spec.instrument,)) if s not in symbols]
        return CryptofeedAdapter(feed.exchange, symbols).events()
    assert feed.path is not None
    opts = group.read or ReadOptions()
    insts = {s.instrument for s in group.sessions}
    if len(insts) == 1 and not opts.instrument:  # tables without a symbol column belong to the sessions' one
        opts = replace(opts, instrument=insts.pop())
    sources = open_recorded(str(feed.path).split(","), opts, what=f"feed {feed.kind}")
    for src in sources:
        for note in getattr(src, "notes", []):
            log.warning("feed %s: %s", feed, note)
    return apaced(merge(*sources), speed)


def venue_symbols(group: FeedGroup) -> list[str]:
    """What a live venue group subscribes: each session's symbols (default its instrument as the venue spells
    it), each once, in config order."""
    symbols: list[str] = []
    seen: set[str] = set()
    for spec in group.sessions:
        own = spec.feed.symbols if spec.feed.kind == group.feed.kind else ()
        for symbol in own or (venue_symbol(group.feed.kind, spec.instrument),):
            if symbol not in seen:
                seen.add(symbol)
                symbols.append(symbol)
    return symbols


def venue_adapters(group: FeedGroup) -> list[FeedAdapter]:
    """One adapter per connection a live venue group needs: all its sessions' symbols on as few connections
    as the venue allows (`feeds.adapters.connection_shards`: Binance's 1024 streams a connection), each
    symbol on one. Every adapter reconnects on its own, so an outage of one touches only its symbols."""
    feed = group.feed
    credentials = venue_credentials(feed.kind)
    return [FeedAdapter(feed.kind, shard, url=feed.url or None, credentials=credentials)
            for shard in venue_shards(group)]


def venue_shards(group: FeedGroup) -> list[list[str]]:
    """The symbols of each connection a live venue group opens."""
    return connection_shards(group.feed.kind, venue_symbols(group), channels_for(group.feed.kind))


def attach_mode(feed: FeedSpec, spec: SessionSpec) -> str:
    """How a session takes its feed: files of ready-made bars are already bars, rendered one line each
    ("events"); anything else as the session's render mode says."""
    is_bar_file = feed.kind in ("replay", "csv") and not str(feed.path).endswith(".gz") and \
        not any(k in str(feed.path).lower() for k in ("trade", "quote"))
    return "events" if is_bar_file else spec.render.mode


def build_attachments(sink: Any, owner: Owner, group: FeedGroup, log: IngestLog | None = None) -> list[Any]:
    """One attachment per session of the group; `sink` is the engine, or a TapSink in front of it.
    log: the engine's ingest log, where a recorded feed's batches carry their position (resume after it)."""
    out = []
    for spec in group.sessions:
        mode = attach_mode(group.feed, spec)
        name = owner.engine_name(spec.name)
        # Recorded feeds are replayable: batches carry their position, a restart resumes after the log's.
        feed_id = str(group.feed) if group.feed.kind in ("replay", "csv") else None
        logged = log.feed_position(name, feed_id) if feed_id and log is not None else None
        out.append(Attachment(sink, AttachSpec.of(spec, session=name, mode=mode), feed_id=feed_id,
                              resume_from=logged, questions=spec.questions))
    return out


def open_sessions(engine: EngineClient, owner: Owner, config: QueryConfig) -> int:
    registered = 0
    recovered = {info.name for info in engine.list_sessions()}
    for spec in config.sessions:
        name = owner.engine_name(spec.name)
        have: set[str] = set()
        if name in recovered:  # recovered from the ingest log: keep it and its questions
            have = {q.id for q in engine.standing_questions(name)}
        else:
            engine.open_session(name, system=spec.system_prompt, max_context=spec.max_context_tokens,
                                tenant=owner.name)
        for question in spec.questions:
            if question.id not in have:
                engine.register(name, question)
            registered += 1
    return registered
