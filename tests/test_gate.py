from __future__ import annotations

import pytest
import torch

from streamllm.config import QuestionSpec
from streamllm.engine.standing.gate import (
    Gate,
    GateError,
    answer_variants,
    candidate_first_tokens,
    top_two,
)
from streamllm.evaluation.scoring import (
    RiskCoveragePoint,
    margin_ranking,
    risk_coverage,
    threshold_for_precision,
)

VOCAB = 64


class WordTokenizer:
    """Whole words from a fixed table become one token; anything else goes byte by byte."""

    def __init__(self, words: dict[str, int]) -> None:
        self.words = words
        self.pieces = {i: w for w, i in words.items()}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if text in self.words:
            return [self.words[text]]
        return [self.words.get(ch, 32 + ord(ch) % 32) for ch in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.pieces.get(i, chr(ord("a") + i % 26)) for i in ids)


WORDS = WordTokenizer({"up": 1, " up": 2, "Up": 3, " Up": 4, "down": 5, " down": 6, "Down": 7,
                       "yes": 8, "no": 9, " ": 10, "<tok11>": 11})


def question(choices=(), threshold=1.0) -> QuestionSpec:
    return QuestionSpec("q", "Up or down?", tuple(choices), threshold)


def logits_with(values: dict[int, float], floor: float = -10.0) -> torch.Tensor:
    logits = torch.full((VOCAB,), floor)
    for token_id, value in values.items():
        logits[token_id] = value
    return logits


def test_answer_variants_cover_case_and_leading_space():
    assert answer_variants("up") == ["up", " up", "Up", " Up"]
    assert answer_variants("Up") == ["Up", " Up", "up", " up"]
    assert set(answer_variants("BTC")) == {"BTC", " BTC", "btc", " btc"}


def test_candidates_collect_distinct_first_tokens_and_skip_bare_spaces():
    assert candidate_first_tokens(WORDS, "up") == (1, 2, 3, 4)
    assert candidate_first_tokens(WORDS, "down") == (5, 6, 7)  # " Down" starts with the bare " "
    assert 10 not in candidate_first_tokens(WORDS, "no")


def test_choice_scores_the_max_over_its_variants():
    gate = Gate.for_question(question(["up", "down"], threshold=1.0), WORDS)
    assert gate.candidates("up") == (1, 2, 3, 4)
    # " Up" (4) carries "up"; the best "down" variant is "Down" (7).
    decision = gate.decide(logits_with({1: 0.5, 2: 1.0, 3: 2.0, 4: 6.0, 5: 3.0, 6: 4.5, 7: 5.0}))
    assert (decision.fired, decision.answer, decision.token_id, decision.gap) == (True, "up", 4, 1.0)
    decision = gate.decide(logits_with({4: 6.0, 7: 6.5, 20: 50.0}))  # tokens outside the choices don't count
    assert (decision.answer, decision.token_id, decision.gap) == ("down", 7, 0.5)
    assert not decision.fired


def test_fires_exactly_at_threshold():
    gate = Gate.for_question(question(["yes", "no"], threshold=2.0), WORDS)
    assert gate.decide(logits_with({8: 2.5, 9: 0.5})).fired  # gap == 2.0
    assert not gate.decide(logits_with({8: 2.5, 9: 0.625})).fired  # gap 1.875
    zero = Gate.for_question(question(["yes", "no"], threshold=0.0), WORDS)
    assert zero.decide(logits_with({8: 1.0, 9: 1.0})).fired  # threshold 0 always fires


def test_three_choices_gap_is_best_minus_second():
    words = WordTokenizer({"up": 1, "down": 2, "flat": 3, " ": 10})
    gate = Gate.for_question(question(["up", "down", "flat"], threshold=0.0), words)
    decision = gate.decide(logits_with({1: 1.0, 2: 4.0, 3: 3.0}))
    assert (decision.answer, decision.gap) == ("down", 1.0)


def test_colliding_first_tokens_are_rejected_at_load_time():
    with pytest.raises(GateError, match=r"'up' and 'upward' can both start with token"):
        Gate.for_question(question(["up", "upward"]), WordTokenizer({"up": 1, "upward": 1}))
    shared_byte = WordTokenizer({})  # every choice is spelled byte by byte: "ab" and "ac" share "a"
    with pytest.raises(GateError, match=r"question 'q': choices 'ab' and 'ac'.*first token cannot tell"):
        Gate.for_question(question(["ab", "ac"]), shared_byte)


def test_without_choices_compares_top_two_of_the_vocabulary():
    gate = Gate.for_question(question(threshold=3.0), WORDS)
    decision = gate.decide(logits_with({11: 9.0, 30: 6.0, 2: 5.0}))
    assert (decision.fired, decision.answer, decision.token_id, decision.gap) == (True, "<tok11>", 11, 3.0)
    assert not gate.decide(logits_with({11: 9.0, 30: 8.0})).fired


def test_top_two_fast_path_agrees_with_topk():
    torch.manual_seed(0)
    for _ in range(20):
        logits = torch.randn(1000)
        best, best_id, second = top_two(logits)  # float32 CPU: numpy path
        values, ids = logits.double().topk(2)  # float64: topk path
        assert (best, best_id, second) == (values[0].item(), ids[0].item(), values[1].item())
    tied = torch.tensor([1.0, 5.0, 2.0, 5.0])
    assert top_two(tied)[0] - top_two(tied)[2] == 0.0
    assert top_two(tied.double())[0] - top_two(tied.double())[2] == 0.0
    assert top_two(torch.tensor([7.0, 3.0]))[:2] == (7.0, 0)
    assert top_two(torch.tensor([3.0, 7.0])) == (7.0, 1, 3.0)


def test_works_on_float16_and_the_tiny_tokenizer():
    from streamllm.model import load_tokenizer

    tokenizer = load_tokenizer("tiny")
    gate = Gate.for_question(question(["up", "down"], threshold=1.0), tokenizer)
    up, down = gate.candidates("up"), gate.candidates("down")
    assert up and down and not set(up) & set(down)
    logits = torch.zeros(len(tokenizer), dtype=torch.float16)
    logits[down[-1]] = 3.0
    logits[up[0]] = 1.0
    decision = gate.decide(logits)
    assert (decision.fired, decision.answer, decision.token_id, decision.gap) == (True, "down", down[-1], 2.0)
    free = Gate.for_question(question(threshold=0.5), tokenizer)
    assert free.decide(logits).answer == tokenizer.decode([down[-1]])


# -- calibration -----------------------------------------------------------------------


def test_risk_coverage_on_a_hand_computed_example():
    gaps = [3.0, 0.5, 2.0, 2.0, 1.0]
    correct = [True, False, True, False, True]
    # threshold 3.0 fires on {3.0}: 1/5, 1/1; 2.0 adds both 2.0s: 3/5, 2/3;
    # 1.0 adds one: 4/5, 3/4; 0.5 fires on all: 5/5, 3/5.
    assert risk_coverage(gaps, correct) == [
        RiskCoveragePoint(0.5, 1.0, 0.6),
        RiskCoveragePoint(1.0, 0.8, 0.75),
        RiskCoveragePoint(2.0, 0.6, 2 / 3),
        RiskCoveragePoint(3.0, 0.2, 1.0),
    ]
    curve = risk_coverage(gaps, correct)
    assert threshold_for_precision(curve, 0.7) == (1.0, 0.8, 0.75)  # most coverage reaching 70%
    assert threshold_for_precision(curve, 0.6) == (0.5, 1.0, 0.6)  # reaching exactly counts
    assert threshold_for_precision(curve, 0.9) == (3.0, 0.2, 1.0)
    assert threshold_for_precision([(1.0, 1.0, 0.5)], 0.9) is None  # plain tuples work too
    assert risk_coverage([], []) == []
    with pytest.raises(ValueError, match="2 gaps but 1"):
        risk_coverage([1.0, 2.0], [True])


@pytest.mark.integration
def test_shipped_queries_build_gates_on_the_default_tokenizer():
    from pathlib import Path

    from streamllm.config import load_config
    from streamllm.model import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    paths = sorted((Path(__file__).resolve().parent.parent / "queries").glob("*.toml"))
    assert paths
    for path in paths:
        for session in load_config(path).sessions:
            for spec in session.questions:
                gate = Gate.for_question(spec, tokenizer)  # raises on colliding choices
                for choice in spec.choices:
                    # SmolLM2 has whole-word tokens for these answers, with and without a space.
                    assert len(gate.candidates(choice)) >= 2, (path.name, spec.id, choice)


def test_match_choice_finds_the_first_named_choice_as_a_word():
    from streamllm.evaluation.scoring import match_choice

    assert match_choice("The price is going up.", ("up", "down")) == "up"
    assert match_choice("Down, then up", ("up", "down")) == "down"
    assert match_choice("It is upward", ("up", "down")) is None  # whole words only
    assert match_choice("YES", ("yes", "no")) == "yes"
    assert match_choice("", ("yes", "no")) is None


def test_margin_ranking_is_the_pairwise_share_of_truths_it_orders():
    """Against its definition counted pair by pair: over every (truth up, truth down) pair, 1 where the
    'up' sample leans further toward up, 1/2 on a tie; answers and truths casefolded."""
    import itertools
    import random

    rng = random.Random(5)
    answers = [rng.choice(["up", "Down"]) for _ in range(60)]
    gaps = [round(rng.uniform(0, 2), 1) for _ in range(60)]  # rounded: ties across and within truths
    truths = [rng.choice(["UP", "down"]) for _ in range(60)]
    signed = [g if a.casefold() == "up" else -g for a, g in zip(answers, gaps, strict=True)]
    ups = [m for m, t in zip(signed, truths, strict=True) if t == "UP"]
    downs = [m for m, t in zip(signed, truths, strict=True) if t == "down"]
    pairs = [(u > d) + 0.5 * (u == d) for u, d in itertools.product(ups, downs)]
    assert margin_ranking(answers, gaps, truths, "up") == pytest.approx(sum(pairs) / len(pairs))
    # Perfect, reversed, blind, and undefined with one truth only.
    assert margin_ranking(["up", "down"], [1.0, 1.0], ["up", "down"], "up") == 1.0
    assert margin_ranking(["up", "down"], [1.0, 1.0], ["down", "up"], "up") == 0.0
    assert margin_ranking(["no"] * 4, [3.0] * 4, ["yes", "no", "no", "no"], "yes") == 0.5
    assert margin_ranking(["up", "down"], [1.0, 2.0], ["up", "up"], "up") is None
