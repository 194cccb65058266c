"""serve --ray --spill-dir: each replica evicts its own idle sessions when its cells run out.

Two replicas (Ray actors, tiny model) each with room for two sessions; six sessions open
through the front door. The reference: each session's logits as it answered live, before
anything was evicted (tests/test_pressure.py checks the same for one engine).
"""

from __future__ import annotations

from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'streamllm[ray]' (make test installs it)")

from streamllm.engine import EngineConfig  # noqa: E402
from streamllm.scale.cluster import ClusterEngine  # noqa: E402

# room for two sessions of 512 cells per replica (plus the cells kept for questions), not three
CONFIG = EngineConfig(max_cells=1536, block_size=16, max_context=512, branch_cells=256)
QUESTION = "What is the last close?"


def lines(k: int) -> list[str]:
    return [f"12:00:{i:02d} S{k} C 64{k}{i:02d}.5 V {i}" for i in range(6)]


@pytest.fixture(scope="module")
def spilling(tmp_path_factory):
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    spill = tmp_path_factory.mktemp("spill")
    engine = ClusterEngine("tiny", CONFIG, dtype="float32", replicas=2, log_dir=tmp_path_factory.mktemp("cluster"),
                           call_timeout_s=30, poll_s=0.5, spill_dir=spill)
    yield engine, spill
    engine.shutdown()
    ray.shutdown()


def test_more_sessions_than_the_replicas_hold_spill_per_replica_and_come_back_equal(spilling):
    cluster, spill = spilling
    live = {}
    for k in range(6):
        cluster.open_session(f"s{k}")
        assert cluster.push(f"s{k}", lines(k)).data_version == 1
        live[k] = cluster.ask(f"s{k}", QUESTION, return_logits=True, max_tokens=1, min_version=1)
    placed = {f"s{k}": cluster.placement.get(f"s{k}") for k in range(6)}
    assert sorted(placed.values()) == [0, 0, 0, 1, 1, 1]  # by free cells: three each, one more than fits
    stats = cluster.stats()
    assert stats["auto_evictions"] >= 2 and stats["sessions_evicted"] >= 2
    for h in cluster.replicas:  # each replica spills under its own directory, and still lists what it spilled
        assert h.stats["auto_evictions"] >= 1
        assert list((Path(spill) / f"replica-{h.index}").glob("*.safetensors"))
        held = {n for n, i in placed.items() if i == h.index}
        assert set(cluster.call_replica(h, "ready")["sessions"]) == held  # a restarted front door keeps them placed
    for k in range(6):  # each comes back where it was (evicting another), with the logits it had live
        got = cluster.ask(f"s{k}", QUESTION, return_logits=True, max_tokens=1)
        assert (got.logits - live[k].logits).abs().max().item() <= 1e-4 and got.data_version == 1
        assert cluster.placement.get(f"s{k}") == placed[f"s{k}"]
    assert cluster.stats()["auto_restores"] >= 2
    assert cluster.push("s0", ["12:01:00 late C 1.0"]).data_version == 2  # a push restores too
