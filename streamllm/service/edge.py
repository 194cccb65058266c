"""Who may reach the server at all: the Host and Origin checks in front of every request.

Binding to 127.0.0.1 does not keep web pages out: the browser runs on the same machine. A
page on any site can open `ws://127.0.0.1:8765/` (websockets have no same-origin rule) or
send a "simple" cross-site POST, and DNS rebinding (a name of the attacker's that resolves
to 127.0.0.1) makes the attacker's page same-origin with us. Two checks close that:

    Host     the name the client used must be ours: on a loopback bind localhost, 127.0.0.1
             or [::1] (any port); on another address that address; on a wildcard bind
             (0.0.0.0, ::) loopback names and any IP literal (a rebinding attack always
             needs a DNS name); plus `--allow-host` names (`*` allows any, `*.example.com`
             a domain). No Host header (no browser sends none): allowed.
    Origin   browsers send it; other clients usually do not. A request without Origin is
             allowed; with one it must be the server's own origin (scheme://host:port the
             request's Host names) or an `--allow-origin`; `null` (sandboxed frames, files)
             never is.

The Host check runs first: after it, "same origin as Host" means "same origin as us".
A refused request gets HTTP 403 (`forbidden_host` / `forbidden_origin`), a refused websocket
handshake the same as an HTTP response, before any frame is exchanged.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

FORBIDDEN_HOST = "forbidden_host"
FORBIDDEN_ORIGIN = "forbidden_origin"
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::"})
DEFAULT_PORTS = {"http": 80, "https": 443}


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def split_host(value: str) -> tuple[str, int | None]:
    """`Host` header -> (lower-case name without brackets or trailing dot, port or None); ValueError if malformed."""
    value = value.strip().lower()
    if value.startswith("["):  # [::1]:8765
        name, sep, rest = value[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(value)
        port = rest[1:] or None
    else:
        name, sep, port = value.rpartition(":")
        if not sep or ":" in name:  # no port, or an unbracketed IPv6 address (which has none)
            name, port = value, None
    if port is not None and not (port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(value)
    name = name.rstrip(".")
    if not name:
        raise ValueError(value)
    return name, int(port) if port is not None else None


Origin = tuple[str, str, int]  # (scheme, host, port), port filled in from the scheme


def parse_origin(value: str) -> Origin:
    """`http://host[:port]` -> (scheme, host, port); ValueError for anything else (`null`, paths, other schemes)."""
    parts = urlsplit(value.strip().lower())
    if parts.scheme not in DEFAULT_PORTS or not parts.netloc or parts.path not in ("", "/") or parts.query \
            or parts.fragment or "@" in parts.netloc:
        raise ValueError(value)
    name, port = split_host(parts.netloc)
    return parts.scheme, name, port if port is not None else DEFAULT_PORTS[parts.scheme]


@dataclass(frozen=True, slots=True)
class EdgeRules:
    """The Host and Origin rules of one server (see the module docstring)."""

    hosts: frozenset[str]  # exact host names
    domains: tuple[str, ...] = ()  # `*.example.com` -> ".example.com"
    any_host: bool = False  # --allow-host '*'
    any_ip: bool = False  # a wildcard bind: any IP literal
    origins: frozenset[Origin] = frozenset()
    any_origin: bool = False  # --allow-origin '*'

    @classmethod
    def for_bind(cls, bind_host: str, allowed_hosts: Iterable[str] = (), allowed_origins: Iterable[str] = ()
                 ) -> EdgeRules:
        """The rules of a server bound to `bind_host`; ValueError naming a malformed allowed host or origin."""
        hosts: set[str] = set()
        bind = bind_host.strip("[]").lower()
        wildcard = bind in WILDCARD_BINDS
        if wildcard or is_loopback(bind):
            hosts |= LOOPBACK_NAMES
        else:
            hosts.add(bind)
        domains, any_host = [], False
        for item in allowed_hosts:
            if item == "*":
                any_host = True
            elif item.startswith("*."):
                domains.append(item[1:].lower())
            else:
                try:
                    hosts.add(split_host(item)[0])
                except ValueError:
                    raise ValueError(f"--allow-host {item!r}: expected a host name or address "
                                     "(example.com, 10.0.0.5, [::1]), '*.example.com' or '*'") from None
        origins, any_origin = set(), False
        for item in allowed_origins:
            if item == "*":
                any_origin = True
                continue
            try:
                origins.add(parse_origin(item))
            except ValueError:
                raise ValueError(f"--allow-origin {item!r}: expected scheme://host[:port] with scheme http or "
                                 "https and no path (https://app.example.com, http://localhost:3000), or '*'") from None
        return cls(frozenset(hosts), tuple(domains), any_host, wildcard, frozenset(origins), any_origin)

    def host_allowed(self, name: str) -> bool:
        return (self.any_host or name in self.hosts or (self.any_ip and _is_ip(name))
                or any(name.endswith(d) for d in self.domains))

    def refusal(self, scope: dict[str, Any]) -> tuple[str, str] | None:
        """(code, message) when this HTTP request or websocket handshake must be refused, else None."""
        hosts = [v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"host"]
        origins = [v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"origin"]
        if len(hosts) > 1:  # which one would a proxy, the router or a check believe?
            return FORBIDDEN_HOST, "more than one Host header"
        if len(origins) > 1:
            return FORBIDDEN_ORIGIN, "more than one Origin header"
        host, origin = (hosts or [None])[0], (origins or [None])[0]
        host_port: tuple[str, int | None] | None = None
        if host is not None:
            try:
                host_port = split_host(host)
            except ValueError:
                return FORBIDDEN_HOST, f"malformed Host header {host[:100]!r}"
            if not self.host_allowed(host_port[0]):
                return FORBIDDEN_HOST, (f"Host {host[:100]!r} is not a name of this server (DNS rebinding?): "
                                        "start it with --allow-host NAME to accept it")
        if origin is None or self.any_origin:
            return None
        try:
            scheme, name, port = parse_origin(origin)
        except ValueError:
            return FORBIDDEN_ORIGIN, f"Origin {origin[:100]!r} is not allowed (only http(s)://host:port origins can be)"
        if (scheme, name, port) in self.origins:
            return None
        if host_port is not None and host_port[0] == name and (host_port[1] or DEFAULT_PORTS[scheme]) == port:
            return None  # same origin: the page this server served
        return FORBIDDEN_ORIGIN, (f"Origin {origin[:100]!r} may not use this server (a web page on another site); "
                                  "start it with --allow-origin ORIGIN to allow it")
