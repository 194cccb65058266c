"""The cluster's figures: stats() totals, /health's replica entries, and per-replica Prometheus gauges.

The service's own `streamllm_engine_*` gauges show the cluster's totals (ClusterEngine.stats);
these add one series per replica: `streamllm_replica_<stat>{replica="N"}`, `streamllm_replica_up`,
`streamllm_replica_restarts` and `streamllm_replica_last_recovery_seconds`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from streamllm.engine.outputs import ReplicaUnavailable
from streamllm.scale.handle import ReplicaState


def cluster_stats(cluster: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"model": cluster.model_name, "device": cluster.device, "dtype": cluster.dtype,
                           "adapter": ""}
    totals: dict[str, float] = {}
    for h in cluster.replicas:
        if h.state == ReplicaState.UP:
            with contextlib.suppress(ReplicaUnavailable):
                h.stats = cluster.call_replica(h, "stats", timeout=5.0)
        for key, value in h.stats.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                totals[key] = totals.get(key, 0) + value
    out.update(totals)
    out["replicas"] = len(cluster.replicas)
    out["replicas_up"] = sum(h.state == ReplicaState.UP for h in cluster.replicas)
    out["replica_restarts"] = sum(h.restarts for h in cluster.replicas)
    out["core_alive"] = int(out["replicas_up"] == len(cluster.replicas))
    return out


def replica_health(cluster: Any) -> list[dict[str, Any]]:
    out = []
    for h in cluster.replicas:
        entry = {"replica": h.index, "state": h.state, "sessions": len(cluster.placement.names(h.index)),
                 "restarts": h.restarts, "last_recovery_s": h.last_recovery_s, "node": h.info.get("node", ""),
                 "pid": h.info.get("pid"), "recovery": h.info.get("recovery", "")}
        if h.state != ReplicaState.UP:
            entry["reason"] = h.last_down_reason
        out.append(entry)
    return out


class ReplicaCollector(Collector):
    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster

    def collect(self) -> Iterator[GaugeMetricFamily]:
        replicas = self.cluster.replicas
        up = GaugeMetricFamily("streamllm_replica_up", "1 while the replica serves, 0 while it restarts", labels=["replica"])
        restarts = GaugeMetricFamily("streamllm_replica_restarts", "times the replica was seen down", labels=["replica"])
        recovery = GaugeMetricFamily("streamllm_replica_last_recovery_seconds", "down to serving again, last time",
                                     labels=["replica"])
        families: dict[str, GaugeMetricFamily] = {}
        for h in replicas:
            label = [str(h.index)]
            up.add_metric(label, float(h.state == ReplicaState.UP))
            restarts.add_metric(label, float(h.restarts))
            if h.last_recovery_s is not None:
                recovery.add_metric(label, h.last_recovery_s)
            for key, value in h.stats.items():  # refreshed by stats(), which the service calls just before
                if isinstance(value, int | float) and not isinstance(value, bool):
                    fam = families.get(key)
                    if fam is None:
                        fam = families[key] = GaugeMetricFamily(f"streamllm_replica_{key}", f"replica stats()[{key!r}]",
                                                                labels=["replica"])
                    fam.add_metric(label, float(value))
        yield up
        yield restarts
        yield recovery
        yield from families.values()
