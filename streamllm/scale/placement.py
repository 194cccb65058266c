"""The sticky placement table: which replica holds each session.

Stored as `placement.json` in the cluster's log directory, written durably (temp file,
fsync, rename, fsync of the folder) on every change. Why a file there and not a named
Ray actor: the replicas' ingest logs live in the same directory, so the table and the
data it points to share one fate. A restarted front door reads it before it serves; a
whole Ray cluster restarted on the same directory finds both again (a named actor's
memory would be gone), and a replica that is down is still known to hold its sessions,
so their calls get `unavailable`, not `unknown session`. At start the front door
reconciles it with what each replica says it holds (`reconcile`): the replicas win.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from streamllm.durability.files import make_dirs, write_durably

FORMAT = "streamllm-placement"


class PlacementError(ValueError):
    """placement.json cannot be read (names the file and what is wrong)."""


class PlacementTable:
    def __init__(self, path: str | Path, replicas: int) -> None:
        self.path = Path(path)
        self.replicas = replicas
        self._lock = threading.Lock()
        self._where: dict[str, int] = self._load()

    def _load(self) -> dict[str, int]:
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError) as exc:
            raise PlacementError(f"{self.path}: cannot read the placement table: {exc}") from exc
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("sessions"), dict):
            raise PlacementError(f"{self.path}: not a placement table (expected {{'format': {FORMAT!r}, "
                                 "'sessions': {name: replica}})")
        out = {}
        for name, replica in data["sessions"].items():
            if not isinstance(replica, int) or replica < 0:
                raise PlacementError(f"{self.path}: session {name!r}: replica must be an index >= 0, got {replica!r}")
            out[name] = replica
        return out

    def _save(self) -> None:
        """Under self._lock."""
        make_dirs(self.path.parent)
        body = {"format": FORMAT, "replicas": self.replicas, "sessions": dict(sorted(self._where.items()))}
        write_durably(self.path, json.dumps(body, indent=1).encode())

    def get(self, name: str) -> int | None:
        return self._where.get(name)

    def names(self, replica: int | None = None) -> list[str]:
        with self._lock:
            return [n for n, r in self._where.items() if replica is None or r == replica]

    def counts(self) -> list[int]:
        with self._lock:
            out = [0] * self.replicas
            for r in self._where.values():
                if r < self.replicas:
                    out[r] += 1
            return out

    def place(self, name: str, replica: int) -> None:
        with self._lock:
            self._where[name] = replica
            self._save()

    def remove(self, name: str) -> None:
        with self._lock:
            if self._where.pop(name, None) is not None:
                self._save()

    def reconcile(self, held: dict[int, list[str]]) -> tuple[list[str], list[tuple[str, int]]]:
        """Make the table agree with what the replicas that answered hold.

        Returns (what changed, duplicates): a session held by two replicas (a front door that died
        in the middle of a move) stays where the table says, and the other copy is listed for closing.
        Sessions of replicas that did not answer (absent from `held`) are kept as they are."""
        holders: dict[str, list[int]] = {}
        for replica, names in sorted(held.items()):
            for name in names:
                holders.setdefault(name, []).append(replica)
        changes, duplicates = [], []
        with self._lock:
            for name, where in holders.items():
                keep = self._where.get(name)
                if keep not in where:
                    changes.append(f"{name}: replica {keep} -> {where[0]}")
                    keep = self._where[name] = where[0]
                duplicates += [(name, r) for r in where if r != keep]
            for name, replica in list(self._where.items()):
                if replica >= self.replicas:
                    changes.append(f"{name}: replica {replica} is beyond the {self.replicas} replicas; forgotten")
                    del self._where[name]
                elif replica in held and name not in holders:
                    changes.append(f"{name}: gone from replica {replica}")
                    del self._where[name]
            if changes or not self.path.exists():
                self._save()
        return changes, duplicates
