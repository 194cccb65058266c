"""Prompt layout: system prompt, data lines, question, assistant header.

The session is one open user turn: [system turn][user header]"Market data:\n" then
data lines. A question closes it: "Question: ...<end of turn><assistant header>", so
the decision point is right after the assistant header. Pieces are tokenized
separately and concatenated as ids: nothing is ever re-tokenized as a whole.
"""

from __future__ import annotations

import threading

from transformers import PreTrainedTokenizerBase

DEFAULT_SYSTEM = (
    "You are a market-data analyst. The user streams market data, one line per event or bar. "
    "Answer questions about it briefly and exactly."
)
DATA_HEADER = "Market data:\n"
_SENTINEL = "\x00STREAMLLM_CONTENT\x00"
MAX_CACHED_QUESTIONS = 4096  # questions whose token ids are kept...
MAX_CACHED_QUESTION_CHARS = 256  # ...each this short: the cache stays under ~1 MiB of text and its ids


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
            # The same short questions come back: tokenize them once. Long ones are rare and would let
            # a caller grow the cache to 4,096 x its longest question: they are tokenized every time.
            if len(question) <= MAX_CACHED_QUESTION_CHARS and len(self._question_cache) < MAX_CACHED_QUESTIONS:
                self._question_cache[question] = ids
        return list(ids)

    @property
    def cached_questions(self) -> int:
        """Questions whose token ids are cached (at most MAX_CACHED_QUESTIONS, each of at most
        MAX_CACHED_QUESTION_CHARS characters)."""
        return len(self._question_cache)


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
