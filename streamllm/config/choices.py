"""Choices a gate can tell apart by their first token, checked with the tokenizer alone.

The gate (engine/standing/gate.py) decides a choice question from the logits of the answer's first
token: each choice owns the first tokens of its spellings (`up`, ` up`, `Up`, ` Up`). Two
choices that can start with the same token (`big` / `bigger` on a tokenizer that splits
`bigger` as `big` + `ger`) cannot be told apart. A tokenizer loads without the model's
weights (model/loader.py `load_tokenizer`), so `check_choices` finds such a config before a
server spends seconds loading the model, naming the file and the key.
"""

from __future__ import annotations

from typing import Any

from streamllm.config.specs import ConfigError, QueryConfig


class ChoiceClash(ValueError):
    """Two choices of one question share a candidate first token (or one has none)."""


def _encode(tokenizer: Any, text: str) -> list[int]:
    encoded = tokenizer.encode(text, add_special_tokens=False)
    return list(getattr(encoded, "ids", encoded))  # tokenizers.Tokenizer returns an Encoding


def answer_variants(choice: str) -> list[str]:
    """Spellings the model may start its answer with: as written, lower, Capitalised, each +/- a leading space."""
    cased = dict.fromkeys([choice, choice.lower(), choice[:1].upper() + choice[1:]])
    return [prefix + word for word in cased for prefix in ("", " ")]


def candidate_first_tokens(tokenizer: Any, choice: str) -> tuple[int, ...]:
    """Distinct first-token ids over the answer variants of `choice`.

    A first token that decodes to whitespace alone is skipped: tokenizers that split
    " 42" into " " + "42" would otherwise give every choice the same candidate.
    """
    ids: dict[int, None] = {}
    for variant in answer_variants(choice):
        tokens = _encode(tokenizer, variant)
        if tokens and tokenizer.decode([tokens[0]]).strip():
            ids[tokens[0]] = None
    return tuple(ids)


def first_token_owners(tokenizer: Any, question_id: str, choices: tuple[str, ...]) -> dict[int, int]:
    """{candidate first-token id: index of the choice it belongs to}; ChoiceClash when two choices share one."""
    owner_of: dict[int, int] = {}
    for index, choice in enumerate(choices):
        candidates = candidate_first_tokens(tokenizer, choice)
        if not candidates:
            raise ChoiceClash(f"question {question_id!r}: choice {choice!r} encodes to no usable token")
        for token_id in candidates:
            if token_id in owner_of and owner_of[token_id] != index:
                other = choices[owner_of[token_id]]
                raise ChoiceClash(
                    f"question {question_id!r}: choices {other!r} and {choice!r} can both start "
                    f"with token {tokenizer.decode([token_id])!r} (id {token_id}), so the "
                    "first token cannot tell them apart; use choices whose first tokens differ")
            owner_of[token_id] = index
    return owner_of


def check_choices(config: QueryConfig, tokenizer: Any) -> None:
    """Raise ConfigError (`FILE: sessions[i].questions[j].choices: ...`) for the first question whose
    choices the tokenizer's first tokens cannot tell apart."""
    checked: set[int] = set()  # a template's sessions share one tuple of questions: check it once
    for s, session in enumerate(config.sessions):
        if id(session.questions) in checked:
            continue
        checked.add(id(session.questions))
        for q, question in enumerate(session.questions):
            if not question.choices:
                continue
            try:
                first_token_owners(tokenizer, question.id, question.choices)
            except ChoiceClash as exc:
                block = session.block or f"sessions[{s}]"
                raise ConfigError(config.source, f"{block}.questions[{q}].choices", str(exc)) from None
