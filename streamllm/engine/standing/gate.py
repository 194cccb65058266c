"""The confidence gate: the runtime decision (its offline statistics: evaluation/scoring.py).

At a question's decision point the engine holds the ready distribution (the logits
of the answer's first token). The gate decides from it alone whether the answer is
clear enough to return without a model call:

- with `choices`: each choice owns a set of candidate first-token ids (the first
  token of `choice`, ` choice`, `Choice`, ` Choice`, since the model may answer with
  or without a leading space and capitalised); a choice scores the max logit over its
  set, and the gap is best choice minus second-best choice;
- without choices: top-1 minus top-2 logit over the whole vocabulary.

It fires when gap >= threshold. Candidate sets are built once per question at load
time; `decide` is one gather (or one topk) on the logits plus a few Python floats.

A question with a choice head (`streamllm tune`, streamllm/model/adapter.py) decides
from the head instead: choice logits = W h + b over the decision point's final normed
hidden state h, gap = best minus second-best choice logit, threshold = the head's
calibrated one (the config's threshold is for the LM's own logits), unless the config
says `threshold = "auto:P"`: then the engine sets it live from scored answers
(engine/standing/calibration.py), for a head's gaps or the LM's alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

# answer_variants and candidate_first_tokens: re-exported, the gate's spellings of a choice
from streamllm.config.choices import ChoiceClash, first_token_owners
from streamllm.config.choices import answer_variants as answer_variants
from streamllm.config.choices import candidate_first_tokens as candidate_first_tokens

if TYPE_CHECKING:
    from streamllm.model.adapter import Head


class GateError(ValueError):
    """A question whose choices the tokenizer cannot tell apart by their first token (a config mistake:
    the service answers it as `config_error`)."""


class QuestionLike(Protocol):
    id: str
    choices: tuple[str, ...]
    threshold: float


@dataclass(frozen=True, slots=True)
class GateDecision:
    fired: bool
    answer: str | None  # the choice text, or the decoded top token when there are no choices
    token_id: int  # the winning token (for choices: the best-scoring candidate of the best choice)
    gap: float  # best minus second-best logit
    probs: dict[str, float] | None = None  # choice questions: softmax over the choices' best logits


@dataclass(slots=True)
class Gate:
    question_id: str
    threshold: float
    choices: tuple[str, ...]
    candidate_ids: torch.Tensor | None  # flat long tensor of every choice's candidates
    candidate_owner: tuple[int, ...]  # choice index of each candidate, same order
    candidate_list: tuple[int, ...]  # candidate_ids as Python ints
    tokenizer: Any
    head: Head | None = None  # when an adapter trained one for this question
    auto: bool = False  # threshold = "auto:P": `threshold` is set live (engine/standing/calibration.py), head or not
    # With auto: the live threshold of each answer (choice), absent = closed for it. Evidence is per answer.
    choice_thresholds: dict[str, float] | None = None

    @classmethod
    def for_question(cls, spec: QuestionLike, tokenizer: Any) -> Gate:
        choices = tuple(spec.choices or ())
        auto = getattr(spec, "target_precision", None) is not None
        if not choices:
            return cls(spec.id, float(spec.threshold), (), None, (), (), tokenizer, auto=auto)
        try:  # the config layer checks the same before a model loads (config/choices.py)
            owner_of = first_token_owners(tokenizer, spec.id, choices)
        except ChoiceClash as exc:
            raise GateError(str(exc)) from None
        ids = tuple(owner_of)
        return cls(
            spec.id,
            float(spec.threshold),
            choices,
            torch.tensor(ids, dtype=torch.long),
            tuple(owner_of.values()),
            ids,
            tokenizer,
            auto=auto,
        )

    def candidates(self, choice: str) -> tuple[int, ...]:
        index = self.choices.index(choice)
        return tuple(t for t, o in zip(self.candidate_list, self.candidate_owner, strict=True) if o == index)

    def decide(self, logits: torch.Tensor | None, hidden: torch.Tensor | None = None) -> GateDecision:
        """Decide from the logits at the decision point, shape [vocab] (and its hidden state, for a head;
        a series head's line features alone, logits None, for a head-only entry)."""
        if self.head is not None and hidden is not None:
            return self._decide_head(logits, hidden)
        if self.candidate_ids is None:
            best, token_id, second = top_two(logits)
            gap = best - second
            return GateDecision(gap >= self.threshold, self.tokenizer.decode([token_id]), token_id, gap)
        if self.candidate_ids.device != logits.device:
            self.candidate_ids = self.candidate_ids.to(logits.device)  # once, not per decision
        scores = logits.index_select(0, self.candidate_ids).tolist()
        best_of = [float("-inf")] * len(self.choices)
        best_token = [0] * len(self.choices)
        for score, owner, token_id in zip(scores, self.candidate_owner, self.candidate_list, strict=True):
            if score > best_of[owner]:
                best_of[owner], best_token[owner] = score, token_id
        winner = max(range(len(best_of)), key=best_of.__getitem__)
        runner_up = max(s for i, s in enumerate(best_of) if i != winner)
        gap = best_of[winner] - runner_up
        return GateDecision(gap >= self._threshold_for(self.choices[winner], self.threshold), self.choices[winner],
                            best_token[winner], gap, _softmax(self.choices, best_of))

    def _threshold_for(self, choice: str, fixed: float) -> float:
        """The threshold the gate fires at for this answer: its own live one under auto, else `fixed`."""
        if self.auto and self.choice_thresholds is not None:
            return self.choice_thresholds.get(choice.casefold(), math.inf)
        return fixed


    def _decide_head(self, logits: torch.Tensor, hidden: torch.Tensor) -> GateDecision:
        scores = self.head.logits(hidden).tolist()
        winner = max(range(len(scores)), key=scores.__getitem__)
        gap = scores[winner] - max(s for i, s in enumerate(scores) if i != winner)
        # The token that starts the chosen answer, should the engine decode on from the entry
        # (a head-only entry has no LM logits: its first spelling).
        candidates = self.candidates(self.choices[winner])
        token_id = candidates[0] if logits is None else max(candidates, key=lambda t: float(logits[t]))
        threshold = self._threshold_for(self.choices[winner], self.threshold) if self.auto else self.head.threshold
        return GateDecision(gap >= threshold, self.choices[winner], token_id, gap, _softmax(self.choices, scores))

    @property
    def effective_threshold(self) -> float:
        """The gap the gate fires at now (a head's calibrated one unless the threshold is live)."""
        return self.head.threshold if self.head is not None and not self.auto else self.threshold


def _softmax(choices: Sequence[str], scores: Sequence[float]) -> dict[str, float]:
    top = max(scores)
    weights = [math.exp(x - top) for x in scores]
    total = sum(weights)
    return {c: w / total for c, w in zip(choices, weights, strict=True)}


def top_two(logits: torch.Tensor) -> tuple[float, int, float]:
    """(best logit, its token id, second-best logit) of a [vocab] tensor.

    On CPU float32, numpy's argmax plus two slice maxima, which avoid the thread dispatch
    of torch's topk(2) reduction; other devices and dtypes use topk.
    """
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        values = logits.detach().numpy()
        best_id = int(values.argmax())
        second = max(values[:best_id].max(initial=-math.inf), values[best_id + 1:].max(initial=-math.inf))
        return float(values[best_id]), best_id, float(second)
    top_values, top_ids = logits.topk(2)
    (best, second), (best_id, _) = top_values.tolist(), top_ids.tolist()
    return best, best_id, second
