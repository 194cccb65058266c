"""The fast path: a standing question answered from the core's published ReadyRecord.

Runs in the caller's thread with no round trip to the core: a dictionary read, a
staleness check and an `Answer` built from immutable data; microseconds.
"""

from __future__ import annotations

import time

from streamllm.config import QuestionSpec
from streamllm.engine.outputs import Answer, AnswerPath, FinishReason, ReadyRecord, StalePolicy
from streamllm.engine.standing.prepos import find_standing, is_final

__all__ = ["fast_answer", "find_standing"]


def fast_answer(ready: ReadyRecord | None, spec: QuestionSpec, session_version: int, min_version: int,
                max_tokens: int | None, keep_logits: bool, stale_policy: StalePolicy, eos_ids: set[int],
                t0: float) -> Answer | None:
    """The answer when the record is current (or stale answers are allowed) and final; else None."""
    if ready is None or not is_final(ready, spec, max_tokens or spec.max_tokens, eos_ids):
        return None
    stale = ready.data_version < max(min_version, session_version)
    if stale and (stale_policy != StalePolicy.STALE or ready.data_version < min_version):
        return None
    return Answer(ready.session, spec.text, ready.text, [], ready.data_version, 0, (time.perf_counter() - t0) * 1000,
                  path=AnswerPath.FAST if ready.fired else AnswerPath.ENTRY, confidence=ready.confidence, stale=stale,
                  finish_reason=FinishReason.STOP, logits=ready.logits if keep_logits else None, choices=ready.choices,
                  warming_up=ready.warming_up is not None, warming_up_reason=ready.warming_up)
