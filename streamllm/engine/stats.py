"""The core's counters and gauges, published after every turn of its loop (/health, /metrics, benches)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from streamllm.engine.sequence import SchedClass

if TYPE_CHECKING:
    from streamllm.engine.core import EngineCore


@dataclass(slots=True)
class StepTimes:
    """How long the core's forward steps take (a copy's pace is planned from the moving average)."""

    steps: int = 0
    ms_total: float = 0.0
    ms_last: float = 0.0
    tokens_last: int = 0
    s_ema: float = 0.05

    def record(self, seconds: float, tokens: int) -> None:
        self.steps += 1
        self.ms_total += seconds * 1000
        self.ms_last, self.tokens_last = seconds * 1000, tokens
        self.s_ema += 0.1 * (seconds - self.s_ema)


def core_counters(core: EngineCore) -> dict[str, float]:
    m, sched, times = core.store.manager, core.scheduler.stats, core.step_times
    answerer, compactor, prepos = core.answerer, core.compactor, core.prepos
    standing = prepos.all()  # once: this runs every turn of the core's loop
    jobs = prepos.jobs()
    sessions = core.sessions.values()
    return {
        "sessions": len(core.sessions),
        "standing_questions": len(standing),
        "questions_waiting": len(answerer.waiting) + sum(len(st.waiters) for st in standing),
        "questions_running": len(answerer.running),
        "queue_background": sum(1 for j in jobs if j.sched_class == SchedClass.BACKGROUND),
        "ingest_backlog_tokens": sum(s.pending_tokens for s in sessions),
        "sessions_at_budget": sum(s.at_budget for s in sessions),
        "steps": times.steps,
        "failed_steps": core.failed_steps,
        "steps_failing_in_a_row": core.failing_in_a_row,
        "commands": core.commands,
        "step_ms_avg": times.ms_total / times.steps if times.steps else 0.0,
        "step_ms_last": times.ms_last,
        "step_tokens_last": times.tokens_last,
        "tokens_interactive": sched.tokens[SchedClass.INTERACTIVE],
        "tokens_ingest": sched.tokens[SchedClass.INGEST],
        "tokens_background": sched.tokens[SchedClass.BACKGROUND],
        "background_floor_steps": sched.floor_steps[SchedClass.BACKGROUND],
        "blocked_for_cells": sched.blocked,
        "forward_calls": core.runner.forward_calls,
        "tokens_computed": core.runner.tokens_computed,
        "questions_answered": answerer.questions_answered,
        "questions_preempted": answerer.preemptions,  # cells taken back when every running question was blocked
        "questions_timed_out": answerer.timed_out,  # dropped past their deadline (AskTimeout)
        "entries_computed": prepos.entries_computed,
        "entries_evicted": prepos.entries_evicted,
        "entry_tokens": prepos.entry_tokens,
        "head_only_entries": prepos.head_only_entries,
        "admissions_refused": core.admissions_refused,
        "compactions": sum(s.compactions for s in sessions),
        "compactions_running": len(compactor.copies),
        "compactions_deferred": compactor.deferred,
        "compactions_preempted": compactor.preempted,
        "compaction_tokens": compactor.tokens_computed,  # background tokens spent on copies, swapped or preempted
        "compaction_tokens_shifted": compactor.tokens_shifted,  # cells copies moved without a forward pass
        "sessions_stuck": len(compactor.stuck),  # at budget with no room for a copy (logged): see compacting.py
        "prefix_cache_hits": core.prefixes.hits,
        "cells_total": m.num_blocks * m.block_size,
        "cells_free": m.num_free_blocks * m.block_size,
        "cells_wanted": core.admission.cells_wanted,  # what the pool was short of last turn (admission.py)
        "cells_past_working_sets": core.admission.cells_past_working_sets(),
        "pressure_compactions": core.admission.pressure_compactions,
        "kv_bytes_per_token": core.store.pool.bytes_per_token,
        "core_fast_answers": answerer.fast_answers,
        "core_entry_answers": answerer.entry_answers,
    }
