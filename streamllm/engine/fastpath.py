"""The fast path: a standing question answered from the core's published ReadyRecord.

Runs in the caller's thread with no round trip to the core: a dictionary read, a
staleness check and an `Answer` built from immutable data; microseconds. The record
answers alone when the gate's view is final, or when a free-text answer was already
decoded whole from the same entry (`ReadyRecord.decoded`) and the ask would decode the
same (the question's max_tokens, no stop strings): greedy decoding from one entry
gives one answer, so the answer and its data_version are those of the decode.
"""

from __future__ import annotations

import time

from streamllm.config import QuestionSpec
from streamllm.config.limits import MAX_ASK_TOKENS
from streamllm.engine.outputs import (
    Answer,
    AnswerPath,
    DecodedAnswer,
    FinishReason,
    ReadyRecord,
    StalePolicy,
)
from streamllm.engine.standing.prepos import find_standing, is_final

__all__ = ["decoded_for", "fast_answer", "find_standing"]


def decoded_for(ready: ReadyRecord, spec: QuestionSpec, max_tokens: int | None, stop: list[str] | None) -> DecodedAnswer | None:
    """The answer decoded from `ready`'s entry when an ask of (max_tokens, stop) would decode the same; else None."""
    d = ready.decoded
    if d is None or stop or min(max_tokens or spec.max_tokens, MAX_ASK_TOKENS) != d.max_tokens:
        return None
    return d


def fast_answer(ready: ReadyRecord | None, spec: QuestionSpec, session_version: int, min_version: int,
                max_tokens: int | None, keep_logits: bool, stale_policy: StalePolicy, eos_ids: set[int],
                t0: float, stop: list[str] | None = None) -> Answer | None:
    """The answer when the record is current (or stale answers are allowed) and final or decoded; else None."""
    if ready is None:
        return None
    final = is_final(ready, spec, max_tokens or spec.max_tokens, eos_ids)
    decoded = None if final else decoded_for(ready, spec, max_tokens, stop)
    if not final and decoded is None:
        return None
    stale = ready.data_version < max(min_version, session_version)
    if stale and (stale_policy != StalePolicy.STALE or ready.data_version < min_version):
        return None
    text, tokens, finish = (ready.text, [], FinishReason.STOP) if decoded is None else (
        decoded.text, list(decoded.tokens), decoded.finish_reason)
    return Answer(ready.session, spec.text, text, tokens, ready.data_version, 0, (time.perf_counter() - t0) * 1000,
                  path=AnswerPath.FAST if ready.fired else AnswerPath.ENTRY, confidence=ready.confidence, stale=stale,
                  finish_reason=finish, logits=ready.logits if keep_logits else None, choices=ready.choices,
                  warming_up=ready.warming_up is not None, warming_up_reason=ready.warming_up)
