"""The core's counters and gauges, published after every turn of its loop (/health, /metrics, benches)."""

from __future__ import annotations

from typing import Any

from streamllm.engine.sequence import BACKGROUND


def core_counters(core: Any) -> dict[str, float]:
    m, sched = core.store.manager, core.scheduler.stats
    standing = core.prepos.all()  # once: this runs every turn of the core's loop
    jobs = core.prepos.jobs()
    return {
        "sessions": len(core.sessions),
        "standing_questions": len(standing),
        "questions_waiting": len(core.waiting) + sum(len(st.waiters) for st in standing),
        "questions_running": len(core.running),
        "queue_background": sum(1 for j in jobs if j.sched_class == BACKGROUND),
        "ingest_backlog_tokens": sum(s.pending_tokens for s in core.sessions.values()),
        "sessions_at_budget": sum(s.at_budget for s in core.sessions.values()),
        "steps": core.steps,
        "failed_steps": core.failed_steps,
        "commands": core.commands,
        "step_ms_avg": core.step_ms_total / core.steps if core.steps else 0.0,
        "step_ms_last": core.step_ms_last,
        "step_tokens_last": core.step_tokens_last,
        "tokens_interactive": sched.tokens["interactive"],
        "tokens_ingest": sched.tokens["ingest"],
        "tokens_background": sched.tokens["background"],
        "background_floor_steps": sched.floor_steps["background"],
        "blocked_for_cells": sched.blocked,
        "forward_calls": core.runner.forward_calls,
        "tokens_computed": core.runner.tokens_computed,
        "questions_answered": core.questions_answered,
        "entries_computed": sum(st.entries_computed for st in standing),
        "entries_evicted": core.prepos.entries_evicted,
        "entry_tokens": core.prepos.entry_tokens,
        "head_only_entries": core.prepos.head_only_entries,
        "admissions_refused": core.admissions_refused,
        "compactions": sum(s.compactions for s in core.sessions.values()),
        "compactions_running": len(core.compactions),
        "compactions_deferred": core.compactions_deferred,
        "compactions_preempted": core.compactions_preempted,
        "sessions_stuck": len(core.stuck),  # at budget with no room for a copy (logged): see compacting.py
        "prefix_cache_hits": core.prefixes.hits,
        "cells_total": m.num_blocks * m.block_size,
        "cells_free": m.num_free_blocks * m.block_size,
        "kv_bytes_per_token": core.store.pool.bytes_per_token,
        "core_fast_answers": core.fast_answers,
        "core_entry_answers": core.entry_answers,
    }
