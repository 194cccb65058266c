"""Prometheus metrics of one server: its own CollectorRegistry, never the global one.

Service counters are updated as messages flow; engine figures are read from
`engine.stats()` at scrape time, so the engine carries no metrics code of its own.
A scrape's size does not grow with the sessions past `SESSION_SERIES_CAP`: beyond it the
per-session question series give way to per-question aggregates (min, mean, max).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# Round trips on the fast path are sub-millisecond; cold answers on a CPU take seconds.
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Per-session question series up to this many sessions; past it, aggregates per question (a scrape of
# 500 sessions x 5 questions x 12 figures would be 30,000 series).
SESSION_SERIES_CAP = 64


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for key, value in self._stats().items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                yield GaugeMetricFamily(f"streamllm_engine_{key}", f"engine.stats()[{key!r}]", value=value)


class _CalibrationCollector(Collector):
    """Live precision / coverage / accuracy / base rate / threshold per labelled standing question, and an auto
    gate's target and confidence (so an alert reads `precision < on(session, question) target`); the newest point
    of its learning curve, and for a question that learns live, its heads fitted and samples kept."""

    FIGURES = ("precision", "coverage", "accuracy", "base_rate", "threshold", "samples", "target", "confidence")
    # name -> (help, where it is in the figures): only a question whose figures have it gets a sample
    EXTRA = {
        "recent_accuracy": ("learning curve: accuracy of the newest scored answers (the newest history point)",
                            lambda c: c["history"][-1][1] if c.get("history") else None),
        "recent_base_rate": ("learning curve: base rate of the newest scored answers (the newest history point)",
                             lambda c: c["history"][-1][2] if c.get("history") else None),
        "learned_heads": ("live learning: heads fitted so far", lambda c: (c.get("learning") or {}).get("fits")),
        "learning_samples": ("live learning: training samples kept",
                             lambda c: (c.get("learning") or {}).get("samples")),
        "answer_accuracy": ("live learning: accuracy of the answers given, on those the control answered too",
                            lambda c: (c.get("learning") or {}).get("answer_accuracy")),
        "control_accuracy": ("live learning: accuracy of the control (the same head on the lines' own numbers, "
                             "no model) on the same answers", lambda c: (c.get("learning") or {}).get("control_accuracy")),
    }

    def __init__(self, calibration: Callable[[], dict[str, dict[str, dict]]], max_sessions: int = SESSION_SERIES_CAP) -> None:
        self._calibration = calibration
        self.max_sessions = max_sessions

    def collect(self) -> Iterator[GaugeMetricFamily]:
        by_session = self._calibration()
        if len(by_session) > self.max_sessions:
            yield from self._aggregates(by_session)
            return
        families = {f: GaugeMetricFamily(f"streamllm_question_{f}", f"live calibration: {f} over the rolling "
                                         "window of scored standing answers", labels=["session", "question"])
                    for f in self.FIGURES}
        extra = {f: GaugeMetricFamily(f"streamllm_question_{f}", doc, labels=["session", "question"])
                 for f, (doc, _) in self.EXTRA.items()}
        for session, questions in by_session.items():
            for question_id, figures in questions.items():
                for f in self.FIGURES:
                    if figures.get(f) is not None:
                        families[f].add_metric([session, question_id], figures[f])
                for f, (_, read) in self.EXTRA.items():
                    value = read(figures)
                    if value is not None:
                        extra[f].add_metric([session, question_id], value)
        yield from families.values()
        yield from extra.values()

    def _aggregates(self, by_session: dict[str, dict[str, dict]]) -> Iterator[GaugeMetricFamily]:
        """Past `max_sessions` sessions, one series per question id and figure (min, mean, max over the
        sessions that have it) instead of one per session: a scrape stays the same size at 500 sessions."""
        values: dict[tuple[str, str], list[float]] = {}
        for questions in by_session.values():
            for question_id, fig in questions.items():
                for f in self.FIGURES:
                    if fig.get(f) is not None:
                        values.setdefault((f, question_id), []).append(float(fig[f]))
                for f, (_, read) in self.EXTRA.items():
                    value = read(fig)
                    if value is not None:
                        values.setdefault((f, question_id), []).append(float(value))
        sessions = GaugeMetricFamily("streamllm_question_sessions", "sessions with this standing question's figures "
                                     f"(more than {self.max_sessions} sessions: figures aggregated over them)",
                                     labels=["question"])
        counted: dict[str, int] = {}
        for questions in by_session.values():
            for question_id in questions:
                counted[question_id] = counted.get(question_id, 0) + 1
        for question_id, n in sorted(counted.items()):
            sessions.add_metric([question_id], n)
        yield sessions
        for f in (*self.FIGURES, *self.EXTRA):
            family = GaugeMetricFamily(f"streamllm_question_{f}_over_sessions", f"{f} of each standing question: "
                                       "min, mean and max over the sessions that have it", labels=["question", "stat"])
            for (name, question_id), vs in sorted(values.items()):
                if name == f:
                    for stat, v in (("min", min(vs)), ("mean", sum(vs) / len(vs)), ("max", max(vs))):
                        family.add_metric([question_id, stat], v)
            yield family


class ServerMetrics:
    def __init__(self, engine_stats: Callable[[], dict[str, Any]],
                 calibration: Callable[[], dict[str, dict[str, dict]]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.connections = Gauge("streamllm_connections", "open websocket connections", registry=r)
        self.subscriptions = Gauge("streamllm_subscriptions", "active session subscriptions", registry=r)
        self.messages = Counter("streamllm_messages", "client messages by type", ["type"], registry=r)
        self.errors = Counter("streamllm_errors", "error replies by code", ["code"], registry=r)
        self.answers = Counter("streamllm_answers", "answers sent by path", ["path"], registry=r)
        self.ask_seconds = Histogram("streamllm_ask_seconds", "server-side ask time, request to answer",
                                     ["path"], buckets=LATENCY_BUCKETS, registry=r)
        self.events = Counter("streamllm_events", "standing/data events queued to clients", ["type"], registry=r)
        self.slow_disconnects = Counter("streamllm_slow_disconnects",
                                        "connections cut because their outgoing queue filled", registry=r)
        self.lines_pushed = Counter("streamllm_lines_pushed", "data lines accepted by push", registry=r)
        r.register(_EngineCollector(engine_stats))
        # Per-session labels name tenants' sessions: rendered only for a viewer who may see every session.
        self.private_registry = CollectorRegistry(auto_describe=True)
        if calibration is not None:
            self.private_registry.register(_CalibrationCollector(calibration))

    def render(self, private: bool = False) -> bytes:
        """The text format; `private`: with the per-session series (a tokenless server, or an admin token)."""
        text = generate_latest(self.registry)
        return text + generate_latest(self.private_registry) if private else text
