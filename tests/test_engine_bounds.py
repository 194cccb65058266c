"""What one caller can learn or grow inside the engine: shared prefixes stay within a tenant, and the
question cache keeps only short questions."""

from __future__ import annotations

from streamllm.engine import Engine, EngineConfig
from streamllm.engine.prompt import MAX_CACHED_QUESTION_CHARS

SYSTEM = "Same system prompt for every instrument."


def test_a_tenant_cannot_tell_that_another_cached_its_system_prompt(tiny_model):
    with Engine(tiny_model, EngineConfig(max_cells=8192, block_size=8, max_context=512)) as eng:
        eng.open_session("a", SYSTEM, tenant="alice")
        eng.push("a", ["1 2 3"])
        assert eng.wait_idle(30)
        same_tenant = eng.open_session("a2", SYSTEM, tenant="alice")
        other_tenant = eng.open_session("b", SYSTEM, tenant="bob")
        fresh = eng.open_session("c", "Another system prompt for bob.", tenant="bob")
        assert same_tenant.num_computed > 0  # alice's own prefix is shared with her
        assert other_tenant.num_computed == fresh.num_computed == 0  # bob sees what a cold prefix shows
        assert eng.stats()["prefix_cache_hits"] == 1
        eng.push("b", ["1 2 3"])
        x = eng.ask("a", "Trend?", max_tokens=3, min_version=1)
        y = eng.ask("b", "Trend?", max_tokens=3, min_version=1)
        assert x.tokens == y.tokens  # computed apart, the same answer
        eng.check_integrity()


def test_the_question_cache_keeps_only_short_questions(tiny_model):
    with Engine(tiny_model, EngineConfig(max_cells=4096, block_size=8, max_context=512)) as eng:
        layout = eng.layout
        before = layout.cached_questions
        long = "how " * (MAX_CACHED_QUESTION_CHARS // 4 + 1)
        assert layout.question_ids(long) == layout.question_ids(long)  # tokenized each time, the same ids
        assert layout.cached_questions == before
        short = "Trend now?"
        ids = layout.question_ids(short)
        assert layout.cached_questions == before + 1
        ids.append(0)  # a caller's copy: the cached ids are never handed out
        assert layout.question_ids(short) == ids[:-1]
