"""The durability parts of `streamllm bench faults` (in-process, tiny model by default).

    power_loss       acked pushes through Engine + IngestLog, then a simulated power loss
                     (bench/powerloss.py): acked events missing from what survives, per policy
    bounded          recovery time after 1 minute vs 1 hour of feed-equivalent data (one bar
                     line a second, pushed as fast as the log takes it), checkpoints on
    feed_restart     a recorded feed killed mid-way and restarted from its beginning:
                     lines delivered twice or never, against an uninterrupted run
    pressure         more sessions than the pool holds: auto evictions, restored vs live logits
                     (max abs difference; a restore is exact, so anything but 0 is a bug)
"""

from __future__ import annotations

import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any

QUESTION = "What is the last close?"


def _bar(v: int) -> list[str]:
    return [f"{v // 3600 % 24:02d}:{v // 60 % 60:02d}:{v % 60:02d} BTCUSDT C 640{v % 90:02d}.{v % 10} V {v % 7}.5"]


def power_loss(loaded: Any, work: Path, pushes: int = 60) -> dict[str, float]:
    from bench.powerloss import PowerLoss
    from streamllm.durability.ingest_log import IngestLog
    from streamllm.durability.log_reader import pushed_lines
    from streamllm.engine import Engine, EngineConfig

    out: dict[str, float] = {}
    for flush in ("batch", "interval"):
        root = work / f"pl-{flush}"
        root.mkdir(parents=True)
        with PowerLoss(root) as pl:
            eng = Engine(loaded, EngineConfig(max_cells=8192, max_context=4096), ingest_log=IngestLog(root / "log", flush=flush))
            eng.open_session("s")
            acked = []
            for v in range(1, pushes + 1):
                eng.push("s", _bar(v))
                acked += _bar(v)
            now = pushed_lines(pl.image(work / f"img-{flush}-now") / "log").get("s", [])
            time.sleep(3 * eng.ingest_log.fsync_ms / 1000)  # the interval policy's window has passed
            later = pushed_lines(pl.image(work / f"img-{flush}-later") / "log").get("s", [])
            eng.shutdown()
            eng.ingest_log.close()
        for when, got in (("", now), ("_after_window", later)):
            assert got == acked[: len(got)], "a power loss must lose a suffix at most"
            out[f"power_loss_events_lost_{flush}{when}"] = len(acked) - len(got)
    out["power_loss_events_lost"] = out["power_loss_events_lost_batch"]  # the policy that promises it
    return out


def _recovery_s(loaded: Any, work: Path, seconds: int, every: int) -> dict[str, float]:
    from streamllm.durability.ingest_log import IngestLog
    from streamllm.durability.recovery import recover
    from streamllm.engine import Engine, EngineConfig

    # A minute of bars already fills the context (compaction from then on): a session's size is
    # bounded by max_context, so recovery is bounded by it and the checkpoint interval.
    config = EngineConfig(max_cells=16384, max_context=1024)
    log_dir = work / f"bounded-{seconds}-{every}"
    log = IngestLog(log_dir, flush="interval", checkpoint_versions=every)
    eng = Engine(loaded, config)
    recover(eng, log)
    if log.checkpointer is None:
        eng.attach_log(log)
    eng.open_session("s")
    tail = every // 2  # the crash comes half a checkpoint interval after the last one could have run
    t0 = time.perf_counter()
    for v in range(1, seconds - tail + 1):
        eng.push("s", _bar(v))
    eng.wait_idle()
    deadline = time.monotonic() + 60
    while log.checkpointer and seconds - tail - log.checkpointer.last.get("s", (0, 0))[0] >= every \
            and time.monotonic() < deadline:
        time.sleep(0.05)  # the background checkpointer catches up
    if log.checkpointer:
        log.checkpointer.stop()
    for v in range(seconds - tail + 1, seconds + 1):
        eng.push("s", _bar(v))
    eng.wait_idle()
    fill_s = time.perf_counter() - t0
    eng.shutdown()
    log.close()
    eng = Engine(loaded, config)
    t0 = time.perf_counter()
    report = recover(eng, IngestLog(log_dir))
    recovery_s = time.perf_counter() - t0
    assert eng.session_info("s").data_version == seconds and not report.failed, (eng.session_info("s"), report)
    eng.shutdown()
    return {"recovery_s": recovery_s, "fill_s": fill_s, "batches": report.batches}


def bounded(loaded: Any, work: Path, every: int = 60, reps: int = 3) -> dict[str, float]:
    import statistics

    short, long = [], []
    for i in range(reps):  # interleaved: drift on a shared machine hits both alike
        short.append(_recovery_s(loaded, work / f"r{i}", 60, every))
        long.append(_recovery_s(loaded, work / f"r{i}", 3600, every))
    full = _recovery_s(loaded, work / "full", 3600, 0)  # checkpoints off: the whole log replayed
    s, lg = statistics.median(r["recovery_s"] for r in short), statistics.median(r["recovery_s"] for r in long)
    return {"recovery_s_1min": s, "recovery_s_1h": lg, "recovery_ratio_1h_vs_1min": lg / s,
            "recovery_s_1h_without_checkpoints": full["recovery_s"],
            "recovery_batches_replayed_1h": statistics.median(r["batches"] for r in long),
            "fill_s_1h": statistics.median(r["fill_s"] for r in long), "checkpoint_every_versions": every}


def feed_restart(loaded: Any, work: Path, crash_at: int = 230) -> dict[str, float]:
    from feeds.events import Trade
    from streamllm.durability.ingest_log import IngestLog
    from streamllm.durability.log_reader import pushed_lines
    from streamllm.durability.recovery import recover
    from streamllm.engine import Engine, EngineConfig
    from streamllm.feeding.attach import Attachment, AttachSpec

    feed = "replay:bench-trades"
    sec = 1_000_000_000
    events = [Trade("t", "BTCUSDT", 1_700_000_000 * sec + i * 370_000_000, 1_700_000_000 * sec + i * 370_000_000,
                    64000 + (i * 7919 % 100) / 10, 0.01 * (1 + i % 3), 1, i) for i in range(400)]

    def run(log_dir: Path, until: int | None) -> Attachment:
        eng, log = Engine(loaded, EngineConfig(max_cells=16384, max_context=4096)), IngestLog(log_dir)
        recover(eng, log)
        if "s" not in eng.sessions:
            eng.open_session("s")
        att = Attachment(eng, AttachSpec("s", mode="bars", bar_s=5, max_backlog=10**6), feed_id=feed,
                         resume_from=log.feed_position("s", feed))
        for n, ev in enumerate(events[:until], 1):
            att.offer(ev)
            if n % 9 == 0:
                att.tick(ev.ts_recv)
                att.flush()
        if until is None:
            att.flush()
        eng.shutdown()  # a crash as far as the log is concerned: nothing is closed or flushed beyond acks
        return att

    run(work / "feed-ref", None)
    run(work / "feed", crash_at)
    att = run(work / "feed", None)
    want, got = Counter(pushed_lines(work / "feed-ref")["s"]), Counter(pushed_lines(work / "feed")["s"])
    return {"replay_feed_duplicates_after_restart": sum((got - want).values()),
            "replay_feed_missing_after_restart": sum((want - got).values()),
            "replay_feed_lines_resumed": att.stats.resumed_lines}


def pressure(loaded: Any, work: Path, sessions: int = 6) -> dict[str, float]:
    from streamllm.durability.resident import ResidentEngine
    from streamllm.engine import Engine, EngineConfig

    eng = ResidentEngine(Engine(loaded, EngineConfig(max_cells=1536, block_size=16, max_context=512, branch_cells=256)),
                         work / "spill", auto_evict=True)  # two sessions fit
    live = {}
    for k in range(sessions):
        eng.open_session(f"s{k}")
        eng.push(f"s{k}", [f"12:00:{i:02d} S{k} C 64{k}{i:02d}.5 V {i}" for i in range(6)])
        eng.wait_idle()
        live[k] = eng.ask(f"s{k}", QUESTION, return_logits=True, max_tokens=1)
    diff = 0.0
    for k in range(sessions):
        got = eng.ask(f"s{k}", QUESTION, return_logits=True, max_tokens=1)
        diff = max(diff, (got.logits - live[k].logits).abs().max().item())
        eng.wait_idle()
    stats = eng.stats()
    eng.shutdown()
    return {"auto_evictions": stats["auto_evictions"], "auto_restores": stats["auto_restores"],
            "evicted_restore_logit_diff": diff, "pressure_sessions": sessions}


def run_all(model: str, work: Path, *, bounded_reps: int = 3) -> dict[str, float]:
    from streamllm.model import load_model

    loaded = load_model(model, progress=False)
    out: dict[str, float] = {}
    try:
        out |= power_loss(loaded, work)
        out |= feed_restart(loaded, work)
        out |= pressure(loaded, work)
        out |= bounded(loaded, work, reps=bounded_reps)
    finally:
        shutil.rmtree(work / "spill", ignore_errors=True)
    return out
