"""EngineConfig: one immutable object of an engine's settings; a bad value names its field."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from streamllm.engine import CompactionPolicy, EngineConfig, SchedulerConfig
from streamllm.engine.outputs import StalePolicy


def test_stale_policy_takes_the_enum_or_its_value_and_stores_the_enum():
    assert EngineConfig(stale_policy="stale").stale_policy is StalePolicy.STALE
    assert EngineConfig(stale_policy=StalePolicy.WAIT).stale_policy is StalePolicy.WAIT
    with pytest.raises(ValueError, match="stale_policy"):
        EngineConfig(stale_policy="sometimes")


@pytest.mark.parametrize("field", ["max_cells", "block_size", "max_context"])
def test_a_size_that_is_not_positive_names_its_field(field):
    with pytest.raises(ValueError, match=f"EngineConfig.{field}"):
        EngineConfig(**{field: 0})


def test_nested_settings_are_checked_and_the_whole_is_frozen_and_pickles():
    with pytest.raises(ValueError, match="scheduler.step_tokens"):
        EngineConfig(scheduler=SchedulerConfig(step_tokens=0))
    with pytest.raises(ValueError, match="retain"):
        CompactionPolicy(compact_at=0.5, retain=0.6)
    with pytest.raises(ValueError, match="branch_cells"):
        EngineConfig(branch_cells=-1)
    config = EngineConfig(max_cells=4096, block_size=8, scheduler=SchedulerConfig(chunk_tokens=32))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_cells = 1  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(config)) == config  # ClusterEngine sends it to its replicas
    assert config.reserved_branch_cells == 4096 // 8
    assert dataclasses.replace(config, branch_cells=64).reserved_branch_cells == 64
