"""Per-tenant quotas: limits from the token file, enforced by the service (never the engine).

    [quotas."*"]              # the default for every tenant without its own table
    sessions = 4
    [quotas.alice]
    sessions = 16             # open sessions
    standing_questions = 64   # standing questions, over all of the tenant's sessions
    connections = 8           # connections at once: websockets, SSE streams, HTTP completions in flight
    push_lines_per_s = 500    # pushed lines per second (a token bucket; bursts up to one second's worth)
    asks_in_flight = 32       # questions in flight, over all of the tenant's connections

A tenant's own table is all of its limits (a key it leaves out is unlimited). With tokens and
no "*" table, tenants without a table get `DEFAULT_QUOTA`: nothing is unlimited by default.
Without tokens (every connection is `local`) only `asks_in_flight` is bounded, so reconnecting
never resets it. Counts come from the engine itself (its sessions named `tenant/...` and their
standing questions), so a close, an unregister or a restart keeps them right; the push rate,
the questions and the HTTP requests in flight are the service's own state. An HTTP completion
or SSE stream holds a connection while it lasts (a stateless completion opens a temporary
session: without this, a tenant's requests could fill the pool, bounded by nothing).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

DEFAULT = "*"
KEYS = ("sessions", "standing_questions", "connections", "push_lines_per_s", "asks_in_flight")


class QuotaExceeded(Exception):
    """A request over its tenant's quota; the message names the limit and the current use."""


@dataclass(frozen=True, slots=True)
class Quota:
    sessions: int | None = None
    standing_questions: int | None = None
    connections: int | None = None
    push_lines_per_s: int | None = None
    asks_in_flight: int | None = None

    def limits(self) -> dict[str, int]:
        return {key: getattr(self, key) for key in KEYS if getattr(self, key) is not None}


UNLIMITED = Quota()
# With tokens and no [quotas."*"]: what a tenant without its own table may use. Sized for a person or a
# program with a few dozen instruments; the pool's own admission check still applies to every open.
DEFAULT_QUOTA = Quota(sessions=32, standing_questions=256, connections=32, push_lines_per_s=20_000,
                      asks_in_flight=128)
# Without tokens: the one `local` tenant; only its questions in flight are bounded (over all connections).
NO_AUTH_QUOTA = Quota(asks_in_flight=DEFAULT_QUOTA.asks_in_flight)


def parse_quotas(table: Any, where: str, check_name: Callable[[Any, str], str]) -> dict[str, Quota]:
    """The [quotas] table of a token file: {tenant or "*": Quota}; errors name the file and key."""
    if not isinstance(table, dict):
        raise _error(f"{where}: quotas must be a table of [quotas.<tenant>] tables")
    out: dict[str, Quota] = {}
    for tenant, limits in table.items():
        here = f"{where}: quotas.{tenant}"
        if tenant != DEFAULT:
            check_name(tenant, here)
        if not isinstance(limits, dict):
            raise _error(f"{here}: expected a table of limits ({', '.join(KEYS)})")
        values: dict[str, int] = {}
        for key, value in limits.items():
            if key not in KEYS:
                raise _error(f"{here}.{key}: unknown limit; expected one of {', '.join(KEYS)}")
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise _error(f"{here}.{key}: must be a whole number >= 0, got {value!r}")
            values[key] = value
        out[tenant] = Quota(**values)
    return out


class TokenConfigError(ValueError):
    """A token file or STREAMLLM_TOKENS entry that cannot be used; the message says where."""


def _error(message: str) -> Exception:
    return TokenConfigError(message)


@dataclass(slots=True)
class TokenBucket:
    """`rate` tokens per second, holding at most `rate` (one second's burst); full at start."""

    rate: float
    clock: Callable[[], float] = time.monotonic
    level: float = field(init=False)
    stamp: float = field(init=False)

    def __post_init__(self) -> None:
        self.level = float(self.rate)
        self.stamp = self.clock()

    def available(self) -> float:
        now = self.clock()
        self.level = min(float(self.rate), self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        return self.level

    def take(self, n: int) -> bool:
        """Take `n` tokens if there are that many; otherwise take none."""
        if self.available() < n:
            return False
        self.level -= n
        return True


class QuotaBook:
    """Checks one server's tenants against their quotas; counts read from the engine on demand."""

    def __init__(self, quotas: Mapping[str, Quota], engine: Any, clock: Callable[[], float] = time.monotonic,
                 *, auth: bool = True) -> None:
        """auth: whether the server has tokens; it picks the default quota (DEFAULT_QUOTA or NO_AUTH_QUOTA)
        for tenants without a table when there is no "*" one."""
        self.quotas = dict(quotas)
        self.default = self.quotas.get(DEFAULT) or (DEFAULT_QUOTA if auth else NO_AUTH_QUOTA)
        self.engine = engine
        self.clock = clock
        self.buckets: dict[str, TokenBucket] = {}
        self.locks: dict[str, asyncio.Lock] = {}
        self.http: dict[str, int] = {}  # tenant -> HTTP requests and SSE streams in flight
        self.asks: dict[str, int] = {}  # tenant -> questions in flight, websocket and HTTP

    def quota(self, tenant: str) -> Quota:
        return self.quotas.get(tenant) or self.default

    def lock(self, tenant: str) -> asyncio.Lock:
        """Held across check-and-open / check-and-register, so two connections cannot both pass."""
        return self.locks.setdefault(tenant, asyncio.Lock())

    # -- counts, from the engine ------------------------------------------
    def sessions(self, tenant: str) -> list[str]:
        """Engine names of the tenant's client sessions (the HTTP face's `.stateless-*` ones are transient)."""
        temporary = f"{tenant}/."  # the key tenants.Tenant.engine_name gives a '.'-named session
        return [s.name for s in self.engine.list_sessions() if s.tenant == tenant and not s.name.startswith(temporary)]

    def standing_questions(self, tenant: str) -> int:
        total = 0
        for name in self.sessions(tenant):
            try:
                total += len(self.engine.standing_questions(name))
            except Exception:  # closed between the two calls
                continue
        return total

    # -- checks -------------------------------------------------------------
    def check_open(self, tenant: str) -> None:
        limit = self.quota(tenant).sessions
        if limit is not None:
            used = len(self.sessions(tenant))
            if used >= limit:
                raise QuotaExceeded(f"open: tenant {tenant!r} has {used} sessions open, its quota is "
                                    f"sessions = {limit}; close one first")

    def check_register(self, tenant: str, engine_name: str, question_id: str) -> None:
        limit = self.quota(tenant).standing_questions
        if limit is None:
            return
        try:
            if any(q.id == question_id for q in self.engine.standing_questions(engine_name)):
                return  # an id it already has: the engine's own error says so
        except Exception:
            return  # unknown session: the engine's own error says so
        used = self.standing_questions(tenant)
        if used >= limit:
            raise QuotaExceeded(f"register: tenant {tenant!r} has {used} standing questions, its quota is "
                                f"standing_questions = {limit}; unregister one first")

    def check_connect(self, tenant: str, used: int) -> None:
        limit = self.quota(tenant).connections
        if limit is not None and used >= limit:
            raise QuotaExceeded(f"tenant {tenant!r} has {used} connections open, its quota is connections = {limit}")

    def hold_http(self, tenant: str, used: int) -> None:
        """An HTTP request or SSE stream about to start: check the connections quota against the
        tenant's connections now (`StreamServer.connections_of`) and count it; `release_http` when
        it ends, whatever happens."""
        self.check_connect(tenant, used)
        self.http[tenant] = self.http.get(tenant, 0) + 1

    def release_http(self, tenant: str) -> None:
        left = self.http.get(tenant, 0) - 1
        if left < 0:
            raise AssertionError(f"tenant {tenant!r}: an HTTP connection released twice")
        if left:
            self.http[tenant] = left
        else:
            self.http.pop(tenant, None)

    def take_ask(self, tenant: str) -> None:
        """A question about to run (one not answered at once): count it, or refuse it over the tenant's
        `asks_in_flight`; `release_ask` when it ends, whatever happens."""
        limit = self.quota(tenant).asks_in_flight
        used = self.asks.get(tenant, 0)
        if limit is not None and used >= limit:
            raise QuotaExceeded(f"ask: tenant {tenant!r} has {used} questions in flight over all its connections, "
                                f"its quota is asks_in_flight = {limit}; wait for answers")
        self.asks[tenant] = used + 1

    def release_ask(self, tenant: str) -> None:
        left = self.asks.get(tenant, 0) - 1
        if left < 0:
            raise AssertionError(f"tenant {tenant!r}: a question released twice")
        if left:
            self.asks[tenant] = left
        else:
            self.asks.pop(tenant, None)

    def take_push(self, tenant: str, lines: int) -> None:
        """Debit `lines` from the tenant's push bucket, or refuse the whole push."""
        rate = self.quota(tenant).push_lines_per_s
        if rate is None:
            return
        bucket = self.buckets.get(tenant)
        if bucket is None or bucket.rate != rate:
            bucket = self.buckets[tenant] = TokenBucket(rate, self.clock)
        if lines > rate:
            raise QuotaExceeded(f"push: {lines} lines in one push, over the quota of push_lines_per_s = {rate}; "
                                "split it")
        if not bucket.take(lines):
            raise QuotaExceeded(f"push: {lines} lines, but tenant {tenant!r} may push only "
                                f"{int(bucket.available())} more now (quota push_lines_per_s = {rate}); "
                                "nothing of it was accepted, retry later")

    def use(self, tenant: str, connections: int) -> dict[str, Any]:
        """The tenant's quota and its current use, for `stats`."""
        quota = self.quota(tenant)
        use: dict[str, Any] = {"sessions": len(self.sessions(tenant)),
                               "standing_questions": self.standing_questions(tenant), "connections": connections,
                               "asks_in_flight": self.asks.get(tenant, 0)}
        if quota.push_lines_per_s is not None:
            bucket = self.buckets.get(tenant)
            use["push_lines_available"] = int(bucket.available()) if bucket else quota.push_lines_per_s
        return {"limits": quota.limits(), "use": use}
