"""The `queries/*.toml` reader: TOML in, validated specs out (`specs.py`).

Loading validates everything up front; a mistake raises `ConfigError` naming the file,
the key path (`sessions[1].questions[0].choices`) and what is wrong. See docs/questions.md.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from streamllm.config.labels import LabelError, LabelSpec, parse_label
from streamllm.config.limits import MAX_ASK_TOKENS, LimitError, max_tokens_problem, text_problem
from streamllm.config.specs import (
    CHANGE_UNITS,
    DEFAULT_AUTO_CONFIDENCE,
    DEFAULT_BAR_SECONDS,
    DEFAULT_MAX_CONTEXT_TOKENS,
    DEFAULT_MAX_TOKENS_CHOICES,
    DEFAULT_MAX_TOKENS_FREE,
    DEFAULT_SYSTEM_PROMPT,
    DEFAULT_THRESHOLD,
    FEED_KINDS,
    FEEDS_WITH_PATH,
    LIVE_VENUES,
    MAX_CHOICES,
    MAX_SESSION_NAME,
    MIN_CONTEXT_TOKENS,
    RENDER_MODES,
    SYMBOL_PLACEHOLDER,
    ConfigError,
    FeedSpec,
    QueryConfig,
    QuestionSpec,
    RenderSpec,
    SessionSpec,
    is_websocket_url,
    venue_symbol,
)

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\Z")
# A template's symbols as venues spell them: BTCUSDT, BTC-USDT-SWAP, BTC/USD, PI_XBTUSD, BRK.B, ^GSPC.
_SYMBOL = re.compile(r"[A-Za-z0-9^][A-Za-z0-9_.:/^=+-]{0,63}\Z")
_SYMBOL_RULE = "1 to 64 letters, digits or _ . : / ^ = + - (no spaces)"
# Labels yield True -> choices[0]; these words in the wrong slot mean the pair is inverted.
_POSITIVE_WORDS = {"yes", "true", "up", "above", "rising", "higher", "high", "spike", "y"}
_NEGATIVE_WORDS = {"no", "false", "down", "below", "falling", "lower", "low", "normal", "n"}


def load_config(path: str | Path) -> QueryConfig:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(str(path), "", f"cannot read: {exc}") from None
    return parse_config(text, source=str(path), base_dir=path.parent)


def parse_config(
    text_or_dict: str | Mapping[str, Any], source: str = "<string>", base_dir: str | Path | None = None
) -> QueryConfig:
    """Validate a config given as TOML text or an already-parsed dict.

    Relative feed paths resolve against `base_dir` (the config file's folder when
    loaded from a file); without one they stay relative to the working directory.
    """
    reader = _Reader(source, Path(base_dir) if base_dir is not None else None)
    if isinstance(text_or_dict, str):
        try:
            data: Any = tomllib.loads(text_or_dict)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(source, "", f"invalid TOML: {exc}") from None
    else:
        data = text_or_dict
    table = reader.table(data, "")
    reader.keys(table, "", ("sessions", "templates", "model"))
    adapter = reader.model(table.get("model", {}), "model")
    if "sessions" not in table and "templates" not in table:
        raise ConfigError(source, "sessions", "missing (required: an array of tables), or [[templates]] for "
                                              "one session per symbol")
    sessions_data = reader.array_of_tables(table, "", "sessions")
    templates_data = reader.array_of_tables(table, "", "templates")
    if not sessions_data and not templates_data:
        raise ConfigError(source, "sessions", "needs at least one session ([[sessions]], or [[templates]] "
                                              "for one session per symbol)")
    sessions: list[SessionSpec] = []
    names: dict[str, str] = {}  # session name -> the key that made it, for clashes
    for index, session_data in enumerate(sessions_data):
        session = reader.session(session_data, f"sessions[{index}]")
        if session.name in names:
            raise ConfigError(source, f"sessions[{index}].name", f"duplicate session name {session.name!r}")
        names[session.name] = f"sessions[{index}].name"
        sessions.append(session)
    for index, template_data in enumerate(templates_data):
        for session in reader.template(template_data, f"templates[{index}]"):
            if session.name in names:
                raise ConfigError(source, session.key_path, f"makes session name {session.name!r}, which "
                                                            f"{names[session.name]} already names")
            names[session.name] = session.key_path
            sessions.append(session)
    return QueryConfig(source, tuple(sessions), adapter)


def parse_question(data: Mapping[str, Any], source: str = "<question>", key_path: str = "question", *,
                   stored: bool = False) -> QuestionSpec:
    """Validate one question table (also used for questions registered at run time).

    stored: a question read back from an ingest log or a snapshot. It was accepted before
    config/limits.py's bounds existed, so it is kept, never refused: its `max_tokens` is capped at
    MAX_ASK_TOKENS and its text is taken as it is."""
    return _Reader(source, None, stored).question(data, key_path)


_MISSING: Any = object()


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


@dataclass(slots=True)
class _Reader:
    """Typed access to parsed TOML that knows where it is, so every error names its key."""

    source: str
    base_dir: Path | None
    stored: bool = False  # parse_question(stored=True): read back, capped rather than refused

    def fail(self, path: str, problem: str) -> ConfigError:
        return ConfigError(self.source, path, problem)

    def table(self, value: Any, path: str) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise self.fail(path, f"expected a table, got {_kind(value)}")
        return value

    def keys(self, table: Mapping[str, Any], path: str, allowed: tuple[str, ...]) -> None:
        for key in table:
            if key not in allowed:
                close = difflib.get_close_matches(str(key), allowed, n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"allowed: {', '.join(allowed)}"
                raise self.fail(_join(path, str(key)), f"unknown key; {hint}")

    def get(self, table: Mapping[str, Any], path: str, key: str, kinds: tuple[type, ...], what: str,
            default: Any = _MISSING) -> Any:
        if key not in table:
            if default is _MISSING:
                raise self.fail(_join(path, key), f"missing (required: {what})")
            return default
        value = table[key]
        # TOML booleans are ints to Python; never accept one where a number is meant.
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise self.fail(_join(path, key), f"expected {what}, got {_kind(value)} {value!r}")
        return value

    def text(self, table: Mapping[str, Any], path: str, key: str, default: Any = _MISSING) -> str:
        value = self.get(table, path, key, (str,), "a string", default)
        if isinstance(value, str) and not value.strip():
            raise self.fail(_join(path, key), "must not be empty")
        return value

    def name(self, table: Mapping[str, Any], path: str, key: str) -> str:
        value = self.text(table, path, key)
        if not _NAME.match(value):
            raise self.fail(_join(path, key), f"{value!r}: use letters, digits, '_', '.', '-' (no spaces)")
        return value

    def integer(self, table: Mapping[str, Any], path: str, key: str, default: int, minimum: int) -> int:
        value = self.get(table, path, key, (int,), "an integer", default)
        if value < minimum:
            raise self.fail(_join(path, key), f"must be >= {minimum}, got {value}")
        return value

    def within(self, path: str, key: str, problem: str | None) -> None:
        """Raise `LimitError` for a value over one of config/limits.py's bounds (`problem` from its checks)."""
        if problem is not None:
            raise LimitError(self.source, _join(path, key), problem)

    def array_of_tables(self, table: Mapping[str, Any], path: str, key: str, required: bool = False) -> list:
        value = self.get(table, path, key, (list,), "an array of tables", _MISSING if required else [])
        for index, item in enumerate(value):
            self.table(item, f"{_join(path, key)}[{index}]")
        return value

    def model(self, data: Any, path: str) -> Path | None:
        table = self.table(data, path)
        self.keys(table, path, ("adapter",))
        if "adapter" not in table:
            return None
        adapter = Path(self.text(table, path, "adapter")).expanduser()
        if self.base_dir is not None and not adapter.is_absolute():
            adapter = Path(os.path.normpath(self.base_dir.absolute() / adapter))
        return adapter

    def session(self, data: Any, path: str) -> SessionSpec:
        table = self.table(data, path)
        self.keys(table, path, ("name", "instrument", "feed", "symbols", "render", "system_prompt",
                                "max_context_tokens", "questions", "client_pushes"))
        name = self.name(table, path, "name")
        instrument = self.text(table, path, "instrument")
        feed = self.feed(table, path, instrument)
        render = self.render(table.get("render", {}), _join(path, "render"))
        system_prompt = self.text(table, path, "system_prompt", DEFAULT_SYSTEM_PROMPT)
        max_context = self.integer(table, path, "max_context_tokens", DEFAULT_MAX_CONTEXT_TOKENS,
                                   MIN_CONTEXT_TOKENS)
        questions: list[QuestionSpec] = []
        for index, question_data in enumerate(self.array_of_tables(table, path, "questions")):
            question_path = f"{_join(path, 'questions')}[{index}]"
            question = self.question(question_data, question_path)
            for other in questions:
                if other.id == question.id:
                    raise self.fail(f"{question_path}.id", f"duplicate question id {question.id!r}")
                if other.normalized_text == question.normalized_text:
                    raise self.fail(f"{question_path}.text",
                                    f"same text as question {other.id!r} (up to case and spaces)")
            questions.append(question)
        client_pushes = self.get(table, path, "client_pushes", (bool,), "true or false", False)
        return SessionSpec(name, instrument, feed, render,
                           system_prompt.replace("{instrument}", instrument), max_context,
                           tuple(questions), client_pushes, key_path=path)

    def template(self, data: Any, path: str) -> list[SessionSpec]:
        """A [[templates]] block: one session per symbol, sharing everything else (docs/questions.md).

        The shared keys are validated once, as a session of the first symbol at `path`; each symbol
        then gets its name and instrument from the patterns, and its own feed subscription."""
        table = self.table(data, path)
        self.keys(table, path, ("name", "instrument", "symbols", "symbols_file", "feed", "render",
                                "system_prompt", "max_context_tokens", "questions", "client_pushes"))
        symbols = self.template_symbols(table, path)
        name_pattern = self.pattern(table, path, "name", len(symbols))
        instrument_pattern = self.pattern(table, path, "instrument", len(symbols))
        kind = self.text(table, path, "feed", "synthetic").partition(":")[0]
        shared = {k: v for k, v in table.items() if k not in ("name", "instrument", "symbols", "symbols_file")}
        raw_prompt = self.text(table, path, "system_prompt", DEFAULT_SYSTEM_PROMPT)

        def instrument_of(symbol: str) -> str:
            instrument = instrument_pattern.replace(SYMBOL_PLACEHOLDER, symbol)
            return instrument.upper() if kind == "binance" else instrument  # Binance's trades name it so (`s`)

        first_symbol, first_where = symbols[0]
        first = self.session({**shared, "name": self.session_name(name_pattern, first_symbol, first_where),
                              "instrument": instrument_of(first_symbol)}, path)
        out = []
        for symbol, where in symbols:
            instrument = instrument_of(symbol)
            feed = first.feed if first.feed.kind in FEEDS_WITH_PATH or first.feed.kind == "synthetic" else \
                self.feed(shared, path, instrument)
            out.append(replace(first, name=self.session_name(name_pattern, symbol, where), instrument=instrument,
                               feed=feed, system_prompt=raw_prompt.replace("{instrument}", instrument),
                               key_path=where, template=path))
        return out

    def template_symbols(self, table: Mapping[str, Any], path: str) -> list[tuple[str, str]]:
        """(symbol, the key that gave it) in order: `symbols = [...]` or `symbols_file = "PATH"`, one of them."""
        if ("symbols" in table) == ("symbols_file" in table):
            raise self.fail(_join(path, "symbols"), "a template needs either `symbols = [...]` or "
                                                    "`symbols_file = \"PATH\"` (one of them)")
        found: list[tuple[str, str, str]] = []  # (symbol, key, what to say about where)
        if "symbols" in table:
            key = _join(path, "symbols")
            values = self.get(table, path, "symbols", (list,), "a list of strings")
            for index, value in enumerate(values):
                if not isinstance(value, str) or not _SYMBOL.match(value.strip()):
                    raise self.fail(f"{key}[{index}]", f"{value!r} is not a symbol: {_SYMBOL_RULE}")
                found.append((value.strip(), f"{key}[{index}]", f"{key}[{index}]"))
        else:
            key = _join(path, "symbols_file")
            file = Path(self.text(table, path, "symbols_file")).expanduser()
            if self.base_dir is not None and not file.is_absolute():
                file = Path(os.path.normpath(self.base_dir.absolute() / file))
            try:
                lines = file.read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError) as exc:
                raise self.fail(key, f"cannot read {file}: {exc}") from None
            for number, line in enumerate(lines, 1):
                text = line.split("#", 1)[0].strip()
                if not text:
                    continue
                if not _SYMBOL.match(text):
                    raise self.fail(key, f"{file} line {number}: {text!r} is not a symbol: {_SYMBOL_RULE}")
                found.append((text, f"{key}:{number}", f"{file} line {number}"))
        if not found:
            raise self.fail(key, "needs at least one symbol" if "symbols" in table else
                            f"{file} has no symbols (only blank lines and # comments)")
        seen: dict[str, str] = {}
        for symbol, where, said in found:
            folded = symbol.casefold()  # venues' symbols differ by more than case (binance: btcusdt = BTCUSDT)
            if folded in seen:
                if "symbols" in table:
                    raise self.fail(where, f"symbol {symbol!r} repeats {seen[folded]}")
                raise self.fail(key, f"{said}: symbol {symbol!r} repeats {seen[folded]}")
            seen[folded] = said
        return [(symbol, where) for symbol, where, _ in found]

    def pattern(self, table: Mapping[str, Any], path: str, key: str, count: int) -> str:
        """A template's name or instrument pattern: text with `{symbol}` (the default: just the symbol)."""
        value = self.text(table, path, key, SYMBOL_PLACEHOLDER)
        rest = value.replace(SYMBOL_PLACEHOLDER, "")
        if "{" in rest or "}" in rest:
            raise self.fail(_join(path, key), f"{value!r}: the only placeholder is {SYMBOL_PLACEHOLDER}")
        if count > 1 and SYMBOL_PLACEHOLDER not in value:
            raise self.fail(_join(path, key), f"{value!r} would be the same for all {count} symbols: "
                                              f"put {SYMBOL_PLACEHOLDER} in it")
        return value

    def session_name(self, pattern: str, symbol: str, where: str) -> str:
        """The pattern with the symbol, lower case, each run of characters a session name cannot hold as '-'."""
        name = re.sub(r"[^a-z0-9_.-]+", "-", pattern.replace(SYMBOL_PLACEHOLDER, symbol).lower()).strip("-_.")
        if not _NAME.match(name) or len(name) > MAX_SESSION_NAME:
            raise self.fail(where, f"symbol {symbol!r} makes session name {name!r}: a name is 1 to "
                                   f"{MAX_SESSION_NAME} letters, digits, '_', '.' or '-'")
        return name

    def feed(self, table: Mapping[str, Any], path: str, instrument: str) -> FeedSpec:
        text = self.text(table, path, "feed", "synthetic")
        key = _join(path, "feed")
        kind, _, location = text.partition(":")
        if kind not in FEED_KINDS:
            close = difflib.get_close_matches(kind, FEED_KINDS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise self.fail(key, f"unknown feed {kind!r}{hint}; use 'synthetic', a venue ({', '.join(LIVE_VENUES)}; "
                                 "':wss://...' for another endpoint), 'replay:PATH', 'csv:PATH' or "
                                 "'cryptofeed:EXCHANGE'")
        if kind == "cryptofeed":
            if not location.strip():
                raise self.fail(key, "'cryptofeed' needs an exchange: 'cryptofeed:EXCHANGE' (e.g. KRAKEN_FUTURES)")
            return FeedSpec(kind, None, self.symbols(table, path, [instrument]), location.strip().upper())
        if kind in FEEDS_WITH_PATH and not location.strip():
            raise self.fail(key, f"{kind!r} needs a path: '{kind}:PATH'")
        if "symbols" in table and kind not in LIVE_VENUES:
            raise self.fail(_join(path, "symbols"), f"only for live venues and 'cryptofeed', not {kind!r}")
        if kind in LIVE_VENUES:
            url = location.strip()
            if url and not is_websocket_url(url):
                raise self.fail(key, f"after {kind!r}: a websocket endpoint (ws://... or wss://...), got {url!r}")
            symbols = self.symbols(table, path, [venue_symbol(kind, instrument)])
            return FeedSpec(kind, None, tuple(s.lower() for s in symbols) if kind == "binance" else symbols, url=url)
        if location and kind not in FEEDS_WITH_PATH:
            raise self.fail(key, f"{kind!r} takes no path (got {location!r})")
        if kind in FEEDS_WITH_PATH:
            file = Path(location.strip()).expanduser()
            if self.base_dir is not None and not file.is_absolute():
                file = Path(os.path.normpath(self.base_dir.absolute() / file))
            return FeedSpec(kind, file)
        return FeedSpec(kind)

    def symbols(self, table: Mapping[str, Any], path: str, default: list[str]) -> tuple[str, ...]:
        symbols = self.get(table, path, "symbols", (list,), "a list of strings", default)
        if not symbols or not all(isinstance(s, str) and s.strip() for s in symbols):
            raise self.fail(_join(path, "symbols"), f"expected non-empty strings, got {symbols!r}")
        return tuple(s.strip() for s in symbols)

    def render(self, data: Any, path: str) -> RenderSpec:
        table = self.table(data, path)
        self.keys(table, path, ("mode", "bar_seconds", "changes"))
        mode = self.text(table, path, "mode", "bars")
        if mode not in RENDER_MODES:
            raise self.fail(_join(path, "mode"), f"unknown mode {mode!r}; use 'bars' or 'events'")
        if mode == "events":
            for key in ("bar_seconds", "changes"):
                if key in table:
                    raise self.fail(_join(path, key), "only with mode = 'bars'")
            return RenderSpec("events", None)
        changes = self.text(table, path, "changes", "price")
        if changes not in CHANGE_UNITS:
            raise self.fail(_join(path, "changes"), f"unknown unit {changes!r}; use 'price' or 'bp'")
        return RenderSpec("bars", self.integer(table, path, "bar_seconds", DEFAULT_BAR_SECONDS, 1), changes)

    def question(self, data: Any, path: str) -> QuestionSpec:
        table = self.table(data, path)
        self.keys(table, path, ("id", "text", "choices", "threshold", "auto_confidence", "max_tokens", "label",
                                "push", "learn"))
        question_id = self.name(table, path, "id")
        text = self.text(table, path, "text")
        if not self.stored:
            self.within(path, "text", text_problem(text))
        choices = self.choices(table, path)
        threshold, target = self.threshold(table, path)
        default_tokens = DEFAULT_MAX_TOKENS_CHOICES if choices else DEFAULT_MAX_TOKENS_FREE
        max_tokens = self.integer(table, path, "max_tokens", default_tokens, 1)
        if self.stored:
            max_tokens = min(max_tokens, MAX_ASK_TOKENS)
        else:
            self.within(path, "max_tokens", max_tokens_problem(max_tokens))
        label = self.label(table, path, choices)
        push = self.get(table, path, "push", (bool,), "true or false", True)
        if target is not None and label is None:
            raise self.fail(_join(path, "threshold"), "auto thresholds learn from the label: give the question "
                                                      "a `label` (see docs/questions.md) or a number")
        confidence = self.auto_confidence(table, path, target)
        learn = self.get(table, path, "learn", (bool,), "true or false", None)
        if learn and label is None:
            raise self.fail(_join(path, "learn"), "a question learns from its label's truths: give it a `label` "
                                                  "(see docs/questions.md) and choices")
        return QuestionSpec(question_id, text, choices, threshold, max_tokens, label, push, target, confidence, learn)

    def auto_confidence(self, table: Mapping[str, Any], path: str, target: float | None) -> float:
        """How sure an auto threshold must be of its precision: 0.5 <= C < 1, only beside "auto:P"."""
        if "auto_confidence" not in table:
            return DEFAULT_AUTO_CONFIDENCE
        key = _join(path, "auto_confidence")
        if target is None:
            raise self.fail(key, 'only with threshold = "auto:P" (it sets how sure the live threshold must be)')
        value = self.get(table, path, "auto_confidence", (int, float), "a number", DEFAULT_AUTO_CONFIDENCE)
        if not 0.5 <= value < 1:
            raise self.fail(key, f"expected a one-sided confidence with 0.5 <= C < 1 (e.g. 0.9), got {value!r}")
        return float(value)

    def threshold(self, table: Mapping[str, Any], path: str) -> tuple[float, float | None]:
        """(threshold, target precision): a logit gap >= 0, or "auto:P" with 0.5 <= P < 1 (closed: inf)."""
        key = _join(path, "threshold")
        value = self.get(table, path, "threshold", (int, float, str), 'a number or "auto:P"', DEFAULT_THRESHOLD)
        if isinstance(value, str):
            kind, _, target = value.partition(":")
            try:
                precision = float(target)
            except ValueError:
                precision = math.nan
            if kind.strip() != "auto" or not 0.5 <= precision < 1:
                raise self.fail(key, f'expected a number or "auto:P" with 0.5 <= P < 1 (e.g. "auto:0.9"), '
                                     f"got {value!r}")
            return math.inf, precision
        threshold = float(value)
        if not math.isfinite(threshold) or threshold < 0:
            raise self.fail(key, f"must be a finite logit gap >= 0, got {threshold}")
        return threshold, None

    def choices(self, table: Mapping[str, Any], path: str) -> tuple[str, ...]:
        key = _join(path, "choices")
        choices = self.get(table, path, "choices", (list,), "a list of strings", [])
        if "choices" in table and not 2 <= len(choices) <= MAX_CHOICES:
            raise self.fail(key, f"needs 2 to {MAX_CHOICES} choices, got {len(choices)}")
        seen: dict[str, int] = {}
        for index, choice in enumerate(choices):
            if not isinstance(choice, str) or not choice.strip() or choice != choice.strip():
                raise self.fail(f"{key}[{index}]", f"expected a non-empty string without surrounding "
                                                   f"spaces, got {choice!r}")
            folded = choice.casefold()
            if folded in seen:
                raise self.fail(f"{key}[{index}]", f"{choice!r} repeats choices[{seen[folded]}] "
                                                   "(choices are matched regardless of case)")
            seen[folded] = index
        return tuple(choices)

    def label(self, table: Mapping[str, Any], path: str, choices: tuple[str, ...]) -> LabelSpec | None:
        if "label" not in table:
            return None
        key = _join(path, "label")
        try:
            label = parse_label(self.text(table, path, "label"))
        except LabelError as exc:
            raise self.fail(key, str(exc)) from None
        if not label.yes_no:
            if len(choices) != label.choice_count:
                raise self.fail(key, f"label {label.text!r} buckets into {label.choice_count}: the question "
                                     f"needs exactly {label.choice_count} choices (one per bucket, lowest "
                                     f"first), got {len(choices)}")
            return label
        if len(choices) != 2:
            raise self.fail(key, f"label {label.text!r} is a yes/no predicate: the question needs "
                                 f"exactly 2 choices (the answer when true first), got {len(choices)}")
        first, second = (c.casefold() for c in choices)
        if first in _NEGATIVE_WORDS or second in _POSITIVE_WORDS:
            raise self.fail(key, f"choices {list(choices)} look inverted: label {label.text!r} "
                                 "answers choices[0] when true, so put the answer for true first")
        return label


def _kind(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a float", str: "a string",
            list: "an array", dict: "a table"}.get(type(value), type(value).__name__)
