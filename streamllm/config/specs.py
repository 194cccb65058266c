"""What a config says: sessions, feeds, rendering and standing questions, as frozen specs.

These are what the engine, the service and the tools take; `reader.py` builds them from
TOML and is the only place that validates. The defaults and allowed values live here.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streamllm.config.labels import LabelSpec

DEFAULT_THRESHOLD = 2.0  # logit gap; e^2 ~ 7x odds between the top two answers
DEFAULT_AUTO_CONFIDENCE = 0.5  # an auto threshold judges its precision by the point estimate
DEFAULT_MAX_TOKENS_CHOICES = 8  # decoding stops as soon as the answer names a choice
DEFAULT_MAX_TOKENS_FREE = 48
DEFAULT_MAX_CONTEXT_TOKENS = 4096
MIN_CONTEXT_TOKENS = 128
DEFAULT_BAR_SECONDS = 5
DEFAULT_SYSTEM_PROMPT = (
    "You watch live market data for {instrument}. Each line is one bar, oldest first. "
    "Answer each question briefly."
)
LIVE_VENUES = ("binance", "bybit", "coinbase", "kraken", "kraken-futures", "okx", "alpaca")  # native adapters: feeds/adapters.py
FEED_KINDS = ("synthetic", *LIVE_VENUES, "replay", "csv", "cryptofeed")
FEEDS_WITH_PATH = ("replay", "csv")
_WEBSOCKET_URL = re.compile(r"wss?://\S+")


def is_websocket_url(text: str) -> bool:
    """An endpoint a live venue feed may name after its kind ("okx:wss://...")."""
    return _WEBSOCKET_URL.fullmatch(text) is not None


def venue_symbol(venue: str, instrument: str) -> str:
    """What a live venue subscribes for a session that names no symbols: Binance's stream names are
    lower case without separators (btcusdt); other venues take the instrument as they spell it."""
    return re.sub(r"[^a-z0-9]", "", instrument.lower()) if venue == "binance" else instrument
SYMBOL_PLACEHOLDER = "{symbol}"  # in a template's `name` and `instrument` patterns
MAX_SESSION_NAME = 64  # what the websocket protocol accepts (service/protocol.py SESSION_NAME)
RENDER_MODES = ("bars", "events")
CHANGE_UNITS = ("price", "bp")  # how a bar line writes its change and o/h/l offsets (feeding/render.py)
MAX_CHOICES = 16


class ConfigError(ValueError):
    """A config mistake: `source` (file), `key_path` (e.g. `sessions[0].feed`), `problem`."""

    def __init__(self, source: str, key_path: str, problem: str) -> None:
        self.source, self.key_path, self.problem = source, key_path, problem
        super().__init__(f"{source}: {key_path}: {problem}" if key_path else f"{source}: {problem}")


@dataclass(frozen=True, slots=True)
class FeedSpec:
    kind: str  # one of FEED_KINDS
    path: Path | None = None  # replay / csv: resolved against the config file's folder
    symbols: tuple[str, ...] = ()  # live venues: what to subscribe (binance: lower case); cryptofeed: its symbols
    exchange: str = ""  # cryptofeed: the exchange (KRAKEN_FUTURES, BYBIT, ...)
    url: str = ""  # live venues: a websocket endpoint other than the venue's default (testnet, another region)

    def __str__(self) -> str:
        if self.exchange:
            return f"{self.kind}:{self.exchange}"
        if self.url:
            return f"{self.kind}:{self.url}"
        return f"{self.kind}:{self.path}" if self.path is not None else self.kind


@dataclass(frozen=True, slots=True)
class RenderSpec:
    mode: str = "bars"  # "bars": one line per bar; "events": one line per raw event
    bar_seconds: int | None = DEFAULT_BAR_SECONDS  # None in events mode
    changes: str = "price"  # "bp": a bar's change and offsets in basis points of the previous close


@dataclass(frozen=True, slots=True)
class QuestionSpec:
    id: str
    text: str
    choices: tuple[str, ...] = ()  # empty: free answer, gate over the whole vocabulary
    threshold: float = DEFAULT_THRESHOLD
    max_tokens: int = DEFAULT_MAX_TOKENS_FREE
    label: LabelSpec | None = None  # yes/no: True -> choices[0], False -> choices[1]; bucket i -> choices[i]
    push: bool = True
    # threshold = "auto:P": the engine sets the threshold live from labelled answers to reach
    # precision P (engine/standing/calibration.py); `threshold` is then inf (closed) until there is evidence.
    target_precision: float | None = None
    # auto_confidence = C (with "auto:P"): open only where a lower bound of the precision, at one-sided
    # confidence C, reaches P; 0.5 is the point estimate (engine/standing/calibration.py).
    auto_confidence: float = DEFAULT_AUTO_CONFIDENCE
    # Live learning (engine/standing/learning.py): None, a labelled choice question learns a head when it has none of
    # its own; True, it learns even beside an adapter's head (and replaces it once fitted); False, never.
    learn: bool | None = None

    @property
    def threshold_text(self) -> float | str:
        """The threshold as a config writes it (a number, or "auto:P")."""
        return self.threshold if self.target_precision is None else f"auto:{self.target_precision:g}"

    @property
    def normalized_text(self) -> str:
        return normalize_question(self.text)

    def expected_answer(self, bars: Any) -> str | None:
        """Ground truth at the newest of `bars` (present truth); None without a label, with too few
        bars, or for a forecast (its future is not in: see LabelSpec.answer_at)."""
        return None if self.label is None else self.label.answer(bars, self.choices)

    def to_dict(self) -> dict[str, Any]:
        """The question in the form `parse_question` reads back (ingest logs, snapshots)."""
        out: dict[str, Any] = {"id": self.id, "text": self.text, "threshold": self.threshold_text,
                               "max_tokens": self.max_tokens, "push": self.push}
        if self.choices:
            out["choices"] = list(self.choices)
        if self.label is not None:
            out["label"] = self.label.text
        if self.auto_confidence != DEFAULT_AUTO_CONFIDENCE:
            out["auto_confidence"] = self.auto_confidence
        if self.learn is not None:
            out["learn"] = self.learn
        return out


@dataclass(frozen=True, slots=True)
class SessionSpec:
    name: str
    instrument: str
    feed: FeedSpec = field(default_factory=lambda: FeedSpec("synthetic"))
    render: RenderSpec = field(default_factory=RenderSpec)
    system_prompt: str = ""
    max_context_tokens: int = DEFAULT_MAX_CONTEXT_TOKENS
    questions: tuple[QuestionSpec, ...] = ()
    # Whether clients may push lines into the session beside its feed (websocket `push`); refused by default,
    # so a stray push cannot draw into a feed's chart or its questions' data (docs/protocol.md, `forbidden`).
    client_pushes: bool = False
    # Where the config defines it, for messages: "sessions[2]"; for a session a template made, its symbol's key
    # ("templates[0].symbols[5]", or "templates[0].symbols_file:12" for line 12 of the file); "" when built in code.
    key_path: str = ""
    template: str = ""  # the template that made it ("templates[0]"); "" for a session written by hand

    @property
    def block(self) -> str:
        """The config block whose keys it has (its `[[sessions]]` or its `[[templates]]`), for messages
        naming a key such as `feed` or `client_pushes`."""
        return self.template or self.key_path

    def find_question(self, query: str) -> QuestionSpec | None:
        """The standing question with this id, or with this text up to whitespace and case."""
        for question in self.questions:
            if question.id == query:
                return question
        normalized = normalize_question(query)
        for question in self.questions:
            if question.normalized_text == normalized:
                return question
        return None


@dataclass(frozen=True, slots=True)
class QueryConfig:
    source: str
    sessions: tuple[SessionSpec, ...]
    adapter: Path | None = None  # [model] adapter = "DIR": choice heads made by `streamllm tune`

    def session(self, name: str) -> SessionSpec:
        for session in self.sessions:
            if session.name == name:
                return session
        raise KeyError(f"{self.source}: no session {name!r}; have {[s.name for s in self.sessions]}")


def normalize_question(text: str) -> str:
    """Unicode-compatible, case-folded, whitespace collapsed: how ad-hoc asks match standing ones."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())
