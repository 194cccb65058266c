"""Standing-question configs: the specs (`specs.py`) and the `queries/*.toml` reader (`reader.py`).

A config file lists sessions (instrument, feed, rendering, system prompt, context
budget) and each session's standing questions. See docs/questions.md.
"""

from streamllm.config.reader import load_config, parse_config, parse_question
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
    MIN_CONTEXT_TOKENS,
    RENDER_MODES,
    ConfigError,
    FeedSpec,
    QueryConfig,
    QuestionSpec,
    RenderSpec,
    SessionSpec,
    is_websocket_url,
    normalize_question,
    venue_symbol,
)

__all__ = [
    "CHANGE_UNITS", "DEFAULT_AUTO_CONFIDENCE", "DEFAULT_BAR_SECONDS", "DEFAULT_MAX_CONTEXT_TOKENS",
    "DEFAULT_MAX_TOKENS_CHOICES", "DEFAULT_MAX_TOKENS_FREE", "DEFAULT_SYSTEM_PROMPT", "DEFAULT_THRESHOLD",
    "FEED_KINDS", "FEEDS_WITH_PATH", "LIVE_VENUES", "MAX_CHOICES", "MIN_CONTEXT_TOKENS", "RENDER_MODES", "ConfigError",
    "FeedSpec", "QueryConfig", "QuestionSpec", "RenderSpec", "SessionSpec", "is_websocket_url", "load_config",
    "normalize_question", "parse_config", "parse_question", "venue_symbol",
]
