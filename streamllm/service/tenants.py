"""Tenants and bearer tokens: who a connection is, and which engine sessions it may touch.

A token names a tenant. A tenant's sessions live in the engine as `tenant/name`; clients
only ever see `name`, so one tenant cannot name, list or subscribe to another's sessions.
With no token configured, every connection is the tenant `local` (and the server only
binds to loopback). `streamllm serve` without tokens generates one local admin token
(`local_token`) unless `--no-auth`; only a library `StreamServer(engine)` is tokenless by default.

Tokens come from a TOML file and/or `STREAMLLM_TOKENS="tok1=alice,tok2=bob"`:

    [tokens]
    "tok-alice" = "alice"
    "tok-audit" = { tenant = "alice", read_only = true }   # may ask and subscribe only
    "tok-ops" = { tenant = "ops", admin = true }            # operator: may move any tenant's session

    [quotas.alice]                                         # optional limits (see quotas.py)
    sessions = 4
"""

from __future__ import annotations

import hmac
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streamllm.engine.outputs import SessionInfo
from streamllm.service.protocol import SESSION_NAME
from streamllm.service.quotas import DEFAULT, Quota, TokenConfigError, parse_quotas

ENV_VAR = "STREAMLLM_TOKENS"
LOCAL_TENANT = "local"


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    read_only: bool = False
    admin: bool = False  # an operator: moves sessions between replicas, sees engine-wide figures

    def engine_name(self, session: str) -> str:
        """The engine's key for this tenant's session `session`: unique across tenants, opaque to the
        engine (which is told the tenant as a field at open)."""
        return f"{self.name}/{session}"

    def local_name(self, info: SessionInfo) -> str | None:
        """The client-facing name of an engine session, or None when it is not this tenant's."""
        if info.tenant != self.name:
            return None
        return info.name.removeprefix(f"{self.name}/")


def client_name(info: SessionInfo) -> str:
    """The name a session's own tenant knows it by (the engine key for a session opened without one)."""
    return (Tenant(info.tenant).local_name(info) if info.tenant else None) or info.name


LOCAL = Tenant(LOCAL_TENANT)


@dataclass(frozen=True, slots=True)
class Tenants:
    tokens: Mapping[str, Tenant]
    quotas: Mapping[str, Quota] = field(default_factory=dict)  # tenant or "*" -> limits; none: unlimited
    local_token: bool = False  # one generated token for the one local user (`Tenants.local`)

    @classmethod
    def local(cls, token: str) -> Tenants:
        """`streamllm serve` without tokens: one generated token for tenant `local`, an admin, so its one
        user sees what a server without tokens shows (engine-wide stats, queue depths) and is held to
        the same quotas as one, while nobody without the token (another user, a web page) gets in."""
        return cls({_check_token(token, "local token"): Tenant(LOCAL_TENANT, admin=True)}, local_token=True)

    @property
    def auth(self) -> bool:
        return bool(self.tokens)

    @property
    def names(self) -> list[str]:
        return sorted({t.name for t in self.tokens.values()})

    def authenticate(self, token: str) -> Tenant | None:
        # Compare against every token in constant time, so timing does not leak a prefix.
        found = None
        for known, tenant in self.tokens.items():
            if hmac.compare_digest(known.encode(), token.encode()):
                found = tenant
        return found

    def tenant(self, name: str) -> Tenant:
        for tenant in self.tokens.values():
            if tenant.name == name and not tenant.read_only:
                return tenant
        if not self.auth and name == LOCAL_TENANT:
            return LOCAL
        raise TokenConfigError(f"no tenant {name!r} with write access; tenants: {', '.join(self.names) or LOCAL_TENANT}")

    @classmethod
    def load(cls, path: str | Path | None = None, env: str | None = None) -> Tenants:
        """Tokens from `path` (TOML) and from `env` (default: $STREAMLLM_TOKENS); none means no auth."""
        tokens: dict[str, Tenant] = {}
        quotas: dict[str, Quota] = {}
        if path is not None:
            file_tokens, quotas = _from_file(Path(path))
            _merge(tokens, file_tokens, str(path))
        env_value = os.environ.get(ENV_VAR, "") if env is None else env
        if env_value.strip():
            _merge(tokens, _from_env(env_value), ENV_VAR)
        known = {t.name for t in tokens.values()}
        for name in quotas:
            if name != DEFAULT and name not in known:
                raise TokenConfigError(f"{path}: quotas.{name}: no token names tenant {name!r}")
        return cls(tokens, quotas)


def _tenant_name(name: Any, where: str) -> str:
    if not isinstance(name, str) or not SESSION_NAME.match(name):
        raise TokenConfigError(f"{where}: tenant {name!r} must be 1-64 letters, digits, '_', '.' or '-'")
    return name


def _check_token(token: str, where: str) -> str:
    if not token or token != token.strip() or any(c in token for c in ",= \t"):
        raise TokenConfigError(f"{where}: a token must be non-empty, without spaces, ',' or '='")
    return token


def _from_file(path: Path) -> tuple[dict[str, Tenant], dict[str, Quota]]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenConfigError(f"{path}: cannot read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise TokenConfigError(f"{path}: invalid TOML: {exc}") from None
    unknown = set(data) - {"tokens", "quotas"}
    if unknown:
        raise TokenConfigError(f"{path}: unknown key {sorted(unknown)[0]!r}; expected [tokens] and [quotas.<tenant>]")
    quotas = parse_quotas(data["quotas"], str(path), _tenant_name) if "quotas" in data else {}
    table = data.get("tokens")
    if not isinstance(table, dict) or not table:
        raise TokenConfigError(f"{path}: needs a non-empty [tokens] table: \"token\" = \"tenant\"")
    out: dict[str, Tenant] = {}
    for token, value in table.items():
        where = f"{path}: tokens.{token[:4]}..."
        _check_token(token, where)
        if isinstance(value, str):
            out[token] = Tenant(_tenant_name(value, where))
        elif isinstance(value, dict):
            extra = set(value) - {"tenant", "read_only", "admin"}
            if extra:
                raise TokenConfigError(f"{where}: unknown key {sorted(extra)[0]!r} (tenant, read_only, admin)")
            read_only, admin = value.get("read_only", False), value.get("admin", False)
            if not isinstance(read_only, bool) or not isinstance(admin, bool):
                raise TokenConfigError(f"{where}: read_only and admin must be true or false")
            if read_only and admin:
                raise TokenConfigError(f"{where}: an admin token moves sessions, so it cannot be read_only")
            out[token] = Tenant(_tenant_name(value.get("tenant"), where), read_only, admin)
        else:
            raise TokenConfigError(f"{where}: expected a tenant name or {{ tenant = ..., read_only = ..., "
                                   "admin = ... }}")
    return out, quotas


def _from_env(value: str) -> dict[str, Tenant]:
    out: dict[str, Tenant] = {}
    for index, item in enumerate(value.split(",")):
        token, sep, name = item.strip().partition("=")
        where = f"{ENV_VAR}[{index}]"
        if not sep:
            raise TokenConfigError(f"{where}: expected token=tenant")
        out[_check_token(token.strip(), where)] = Tenant(_tenant_name(name.strip(), where))
    return out


def _merge(into: dict[str, Tenant], new: dict[str, Tenant], where: str) -> None:
    for token, tenant in new.items():
        if token in into and into[token] != tenant:
            raise TokenConfigError(f"{where}: a token is given twice, for {into[token].name!r} and {tenant.name!r}")
        into[token] = tenant
