"""Sessions (persistent contexts) and branches (questions that read a session).

A session stores its token ids beside its block table and counts how many are
computed; ingest, chunking and questions all follow from `num_computed` (no phases).

    session tokens: [ frozen prefix | batch 1 | batch 2 | batch 3 (pending) ]
    version_ends:   [ p,              e1,       e2,       e3 ]
    data_version = 2 once e2 <= num_computed; a question forks at version_ends[2].
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from streamllm.engine.kv import BlockTable

DEFAULT_SYSTEM = (
    "You are a market-data analyst. The user streams market data, one line per event or bar. "
    "Answer questions about it briefly and exactly."
)
DATA_HEADER = "Market data:\n"
_SENTINEL = "\x00STREAMLLM_CONTENT\x00"


class PromptLayout:
    """Where data and questions sit in the model's chat template.

    The session is one open user turn: [system turn][user header]"Market data:\\n" then
    data lines. A question closes it: "Question: ...<end of turn><assistant header>",
    so the decision point is right after the assistant header. Pieces are tokenized
    separately and concatenated as ids: nothing is ever re-tokenized as a whole.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        # transformers' fast tokenizer implements split_special_tokens by flipping a flag on the
        # shared Rust tokenizer, so concurrent encodes (pushes and asks from many threads) can
        # tokenize a question's "<|im_end|>" as text. Every encode goes through this lock.
        self.lock = threading.Lock()
        self._question_cache: dict[str, list[int]] = {}
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; streamllm needs one to place questions")
        self.tokenizer = tokenizer
        rendered = tokenizer.apply_chat_template(
            [{"role": "system", "content": _SENTINEL}, {"role": "user", "content": _SENTINEL}],
            tokenize=False,
            add_generation_prompt=True,
        )
        if rendered.count(_SENTINEL) != 2:
            raise ValueError("the chat template does not place system and user content where expected")
        self._system_head, self._user_head, self._tail = rendered.split(_SENTINEL)
        self.eos_ids = self._eos_ids()

    def _eos_ids(self) -> set[int]:
        ids = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        # The end-of-turn marker ends an answer even where eos is a different token.
        end_of_turn = self._tail.split("\n")[0].strip()
        if end_of_turn:
            tok = self.tokenizer.convert_tokens_to_ids(end_of_turn)
            if isinstance(tok, int) and tok != self.tokenizer.unk_token_id:
                ids.add(tok)
        return ids

    def _encode(self, text: str, *, data: bool) -> list[int]:
        # Data and question text can never smuggle in control tokens like <|im_end|>.
        with self.lock:
            return self.tokenizer(text, add_special_tokens=False, split_special_tokens=data)["input_ids"]

    def prefix_ids(self, system: str) -> list[int]:
        return (
            self._encode(self._system_head, data=False)
            + self._encode(system, data=True)
            + self._encode(self._user_head, data=False)
            + self._encode(DATA_HEADER, data=True)
        )

    def lines_ids(self, lines: list[str]) -> list[list[int]]:
        if not lines:
            return []
        with self.lock:
            enc = self.tokenizer([line + "\n" for line in lines], add_special_tokens=False, split_special_tokens=True)
        return enc["input_ids"]

    def question_ids(self, question: str) -> list[int]:
        ids = self._question_cache.get(question)
        if ids is None:
            ids = self._encode(f"Question: {question.strip()}", data=True) + self._encode(self._tail, data=False)
            if len(self._question_cache) < 4096:  # the same questions come back: tokenize them once
                self._question_cache[question] = ids
        return list(ids)


def validate_lines(lines: object) -> list[str]:
    """Lines must be a list of one-line strings; the error names the first bad one."""
    if isinstance(lines, str):
        lines = [lines]
    if not isinstance(lines, (list, tuple)):
        raise TypeError(f"lines must be a list of strings, got {type(lines).__name__}")
    for i, line in enumerate(lines):
        if not isinstance(line, str):
            raise TypeError(f"lines[{i}] must be a string, got {type(line).__name__}")
        if "\n" in line or "\r" in line:
            raise ValueError(f"lines[{i}] contains a line break; push one event per line")
    return list(lines)


class Session:
    def __init__(self, name: str, system: str, prefix_ids: list[int], max_context: int, table: BlockTable) -> None:
        self.name = name
        self.system = system
        self.max_context = max_context
        self.table = table
        self.token_ids: list[int] = list(prefix_ids)
        self.prefix_len = len(prefix_ids)
        self.num_computed = 0
        self.version_ends = [len(prefix_ids)]
        self.version_lines = [0]
        self.data_version = 0
        self.lines_ingested = 0
        self.line_ends: list[int] = []  # token index after each data line (compaction cuts there)
        self.compactions = 0
        self.tokens_dropped = 0  # data tokens compacted away (their lines were ingested and answered on)
        self.closing = False
        self.opened_at = time.time()

    @property
    def ready(self) -> bool:
        """The frozen prefix is computed: questions can fork."""
        return self.num_computed >= self.prefix_len

    @property
    def pushed_version(self) -> int:
        return len(self.version_ends) - 1

    @property
    def pending_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def backlog_lines(self) -> int:
        return sum(self.version_lines[self.data_version + 1 :])

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def append_batch(self, ids_per_line: list[list[int]]) -> int:
        for ids in ids_per_line:
            self.token_ids.extend(ids)
            self.line_ends.append(len(self.token_ids))
        self.version_ends.append(len(self.token_ids))
        self.version_lines.append(len(ids_per_line))
        return self.pushed_version

    def advance(self, num_tokens: int) -> None:
        self.num_computed += num_tokens
        while self.data_version < self.pushed_version and self.version_ends[self.data_version + 1] <= self.num_computed:
            self.data_version += 1
            self.lines_ingested += self.version_lines[self.data_version]

    def version_length(self, version: int) -> int:
        return self.version_ends[version]

    # -- compaction ---------------------------------------------------------
    def compaction_cut(self, keep_tokens: int) -> int | None:
        """The line boundary after which at most keep_tokens data tokens remain (None: nothing to cut)."""
        for end in self.line_ends:
            if self.num_tokens - end <= keep_tokens:
                return end if end > self.prefix_len else None
        return None

    def retained_ids(self, cut: int) -> list[int]:
        """The token ids after compacting at `cut`: frozen prefix, then the data after the cut."""
        return self.token_ids[: self.prefix_len] + self.token_ids[cut:]

    def apply_compaction(self, cut: int, table: BlockTable, num_computed: int) -> None:
        """Swap in the compacted copy (its table holds the first num_computed retained tokens)."""
        shift = cut - self.prefix_len
        self.token_ids = self.retained_ids(cut)
        self.version_ends = [max(self.prefix_len, end - shift) for end in self.version_ends]
        self.line_ends = [end - shift for end in self.line_ends if end > cut]
        self.table = table
        self.num_computed = num_computed
        self.tokens_dropped += shift
        self.compactions += 1


@dataclass(slots=True, eq=False)
class Answer:
    session: str
    question: str
    text: str
    tokens: list[int]
    data_version: int
    tokens_computed: int
    latency_ms: float
    path: str = "cold"
    confidence: float | None = None
    stale: bool = False
    finish_reason: str = "length"  # "stop" (eos or stop string) | "length"
    logits: object = None  # the distribution at the decision point, when asked for (torch.Tensor)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__ if k != "logits"}


@dataclass(slots=True, eq=False)
class Branch:
    """A sequence forked off a session at a data version, on its own blocks.

    purpose: "ask" (a question someone waits for), "entry" (a standing question's
    pre-paid prefill, kept after it completes) or "decode" (a standing answer decoded
    from an entry as idle work).
    """

    session: Session
    question: str
    prompt_ids: list[int]
    max_tokens: int
    stop: list[str]
    future: Future | None
    min_version: int = 0
    t_start: float = field(default_factory=time.perf_counter)
    table: BlockTable | None = None
    base_len: int = 0
    data_version: int = 0
    generated: list[int] = field(default_factory=list)
    num_computed: int = 0  # of prompt_ids + generated
    prepaid: int = 0  # tokens whose KV came with the entry (not computed for this answer)
    finish_reason: str = "length"
    text: str = ""
    keep_logits: bool = False
    first_logits: object = None
    purpose: str = "ask"
    path: str = "cold"
    confidence: float | None = None
    stale: bool = False
    standing: object = None  # the Standing this branch serves, if any
    on_text: object = None  # token streaming: called with each new text delta, on the engine thread; must not raise

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.generated

    @property
    def pending_ids(self) -> list[int]:
        return self.ids[self.num_computed :]

    @property
    def next_pos(self) -> int:
        return self.base_len + self.num_computed
