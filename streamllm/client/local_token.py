"""The local token of `streamllm serve`: generated at start when no tokens are configured (as
Jupyter does), kept in a file only its user can read, found there by the clients of this machine.

    <state>/serve-<port>.token     <state>: $STREAMLLM_HOME, else ~/.cache/streamllm; mode 0600

A client looks for a token in this order: the one it is given (`--token`, `token=`), then
$STREAMLLM_TOKEN, then this file for the URL's port, and only when the URL names this machine
(localhost, 127.0.0.1, [::1]): a remote server is never sent the local token. The server
removes the file when it stops, and at start those of ports nothing listens on any more (servers
that were killed).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import socket
from pathlib import Path
from urllib.parse import urlsplit

TOKEN_ENV = "STREAMLLM_TOKEN"


def state_dir() -> Path:
    """Where streamllm keeps its state (the model cache's folder: model/checkpoint.py's streamllm_home;
    not imported from there, which would load torch into the thin client)."""
    return Path(os.environ.get("STREAMLLM_HOME") or Path.home() / ".cache" / "streamllm").expanduser()


def token_path(port: int) -> Path:
    return state_dir() / f"serve-{port}.token"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def write_token(port: int, token: str) -> Path:
    """Write `token` for the server on `port`, readable by this user only (0600, created so: never
    briefly world-readable), replacing any earlier file atomically."""
    path = token_path(port)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, token.encode() + b"\n")
        os.fchmod(fd, 0o600)  # whatever the umask
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def remove_token(port: int, token: str | None = None) -> None:
    """Remove the file if it still holds `token` (a newer server on the same port keeps its own); with no
    `token`, whatever it holds (a server starting on `port` without a local token: one left by a killed
    server would only have clients send a stale token)."""
    path = token_path(port)
    with contextlib.suppress(OSError):
        if token is None or path.read_text().strip() == token:
            path.unlink()


def prune_stale_tokens(keep: int | None = None) -> list[Path]:
    """Remove the token files of ports nothing on this machine listens on (servers that were killed
    before they could remove their own), except `keep`'s; returns the files removed. A server that
    listens, on the IPv4 or the IPv6 loopback, keeps its file."""
    removed = []
    for path in state_dir().glob("serve-*.token"):
        try:
            port = int(path.stem.removeprefix("serve-"))
        except ValueError:
            continue
        if port == keep or not 0 < port < 65536 or _listening(port):
            continue
        with contextlib.suppress(OSError):
            path.unlink()
            removed.append(path)
    return removed


def _listening(port: int) -> bool:
    for host in ("127.0.0.1", "::1"):
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            continue
    return False


def _local_port(url: str) -> int | None:
    """The port of a ws(s)/http(s) URL naming this machine, else None."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        return None
    if host is None:
        return None
    if host != "localhost":
        try:
            if not ipaddress.ip_address(host).is_loopback:
                return None
        except ValueError:
            return None
    return port or {"ws": 80, "http": 80, "wss": 443, "https": 443}.get(parts.scheme)


def read_token(url: str) -> str | None:
    """The local token of the server at `url` (on this machine), or None."""
    port = _local_port(url)
    if port is None:
        return None
    try:
        token = token_path(port).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return token or None


def find_token(url: str, token: str | None = None) -> str | None:
    """The token to use for `url`: `token` if given, else $STREAMLLM_TOKEN, else the local token file."""
    if token:
        return token
    return os.environ.get(TOKEN_ENV) or read_token(url)
