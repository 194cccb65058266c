"""EngineConfig: every setting of one engine core in one immutable object.

Four groups: the cells (pool size, block size, default context budget, cells kept for
branches), the scheduler (`SchedulerConfig`: step budget, chunk size, floors) and the
compaction policy (`CompactionPolicy`: when a copy starts and what it keeps), and live learning
(`LearnConfig`: what a labelled question without a head learns from, and how often). `Engine`
takes one; `ClusterEngine` pickles the same object to each replica. The composition root
(`cli/serve.py`) builds it from its flags; `dataclasses.replace` derives a variant.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from streamllm.engine.compaction import CompactionPolicy
from streamllm.engine.outputs import StalePolicy
from streamllm.engine.scheduler import SchedulerConfig
from streamllm.engine.standing.learning import LearnConfig

__all__ = ["CompactionPolicy", "EngineConfig", "LearnConfig", "SchedulerConfig"]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_cells: int = 65536  # KV cells in the pool, every session and branch together
    block_size: int = 16  # cells per block
    max_context: int = 8192  # a session's context budget unless its open says otherwise
    branch_cells: int | None = None  # cells sessions cannot reserve (questions, entries); None: max(4 blocks, 1/8)
    # Data cells a session is admitted for beside its frozen prefix (its working set, engine/admission.py); it
    # grows past them up to max_context while the pool has room. 1024: ~22 one-minute bars of bp lines, the
    # window before the last lines series heads read.
    working_set_tokens: int = 1024
    growth_cells: int = 256  # a session grows past its working set in runs of at least this many cells (engine/kv.py)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    compaction: CompactionPolicy = field(default_factory=CompactionPolicy)  # safety=0: cuts by token counts alone
    stale_policy: StalePolicy = StalePolicy.WAIT  # a standing question asked while its entry lags
    head_entries: bool = True  # series heads decide entries without a prefill
    # An ask still unanswered this long after it was submitted is dropped (AskTimeout) and its cells
    # freed; an ask's own deadline_s overrides it. None (or 0): asks have no deadline.
    ask_timeout_s: float | None = 120.0
    check_integrity_every_step: bool = False  # tests: the KV store's invariants after every step
    learning: LearnConfig = field(default_factory=LearnConfig)  # live learning (engine/standing/learning.py)

    def __post_init__(self) -> None:
        for name in ("max_cells", "block_size", "max_context", "working_set_tokens", "growth_cells"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")
        if self.max_cells < self.block_size:
            raise ValueError(f"EngineConfig.max_cells ({self.max_cells}) must hold at least one block "
                             f"of block_size={self.block_size}")
        if self.branch_cells is not None and (not isinstance(self.branch_cells, int) or self.branch_cells < 0):
            raise ValueError(f"EngineConfig.branch_cells must be None or an int >= 0, got {self.branch_cells!r}")
        try:
            # The enum or its value ("wait"/"stale", e.g. from a flag): stored as the enum.
            object.__setattr__(self, "stale_policy", StalePolicy(self.stale_policy))
        except ValueError:
            choices = ", ".join(repr(p.value) for p in StalePolicy)
            raise ValueError(f"EngineConfig.stale_policy must be a StalePolicy ({choices}), "
                             f"got {self.stale_policy!r}") from None
        timeout = self.ask_timeout_s
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)
                                    or not timeout >= 0):
            raise ValueError(f"EngineConfig.ask_timeout_s must be None or a number of seconds >= 0, got {timeout!r}")
        if timeout == 0:
            object.__setattr__(self, "ask_timeout_s", None)
        if not isinstance(self.scheduler, SchedulerConfig):
            raise TypeError(f"EngineConfig.scheduler must be a SchedulerConfig, got {type(self.scheduler).__name__}")
        if not isinstance(self.compaction, CompactionPolicy):
            raise TypeError(f"EngineConfig.compaction must be a CompactionPolicy, got {type(self.compaction).__name__}")
        if not isinstance(self.learning, LearnConfig):
            raise TypeError(f"EngineConfig.learning must be a LearnConfig, got {type(self.learning).__name__}")
        for name in ("step_tokens", "chunk_tokens", "busy_step_tokens"):
            value = getattr(self.scheduler, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"EngineConfig.scheduler.{name} must be a positive int, got {value!r}")

    @property
    def reserved_branch_cells(self) -> int:
        """Cells kept free for branches: `branch_cells`, or max(4 blocks, max_cells / 8)."""
        if self.branch_cells is not None:
            return self.branch_cells
        return max(4 * self.block_size, self.max_cells // 8)
