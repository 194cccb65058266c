"""What other serving designs pay for the same question, on the same model and runner.

  stateless     every question prefills system prompt + all data so far + question from
                scratch (chunked), then decodes: a request-driven server without a cache.
  prefix cache  one cached table per session holds prefix + data up to the previous
                question; a question extends it with the data that arrived since (the
                longest common token prefix is kept, as llama.cpp slots and vLLM/SGLang
                prefix caching do), forks it, prefills the question and decodes.
  peer          any OpenAI-compatible `/v1/completions` server (e.g. llama.cpp's
                llama-server on the same GGUF), sent the same prompt as text with
                `cache_prompt: true`.

Same stopping rule as the engine: a question with choices (`gate=`, the question's own
`Gate`) is answered by the best choice at the first token, with no decoding beyond it;
any other question decodes greedily up to max_tokens or end of turn. The runner
baselines run on the engine's core thread (`Engine.call`): they own the model while
they answer, exactly as a server would.
"""

from __future__ import annotations

import json
import math
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

import torch

from streamllm.engine.kv import BlockTable
from streamllm.engine.runner import Work
from streamllm.engine.standing.gate import Gate
from streamllm.evaluation.scoring import match_choice


@dataclass(slots=True)
class BaselineAnswer:
    text: str
    tokens: list[int]
    ms: float
    tokens_computed: int  # prefill + decode tokens this answer ran through the model
    first_logits: torch.Tensor | None = None  # the decision-point distribution
    choices: dict[str, float] | None = None  # choice questions: each choice's probability


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class _RunnerBaseline:
    def __init__(self, engine, chunk: int = 512) -> None:
        self.engine = engine
        self.runner = engine.runner
        self.store = engine.store
        self.chunk = chunk
        self.eos = engine.layout.eos_ids
        self.tokenizer = engine.tokenizer

    # Every public method runs on the engine's core thread (`engine.call`): the core is the one
    # writer of the KV pool, and a baseline occupies the model exactly as a server would.
    def _on_core(self, fn, *args):
        return self.engine.call(lambda _core: fn(*args))

    def _grow(self, table: BlockTable, n: int) -> None:
        self.store.manager.append(table, n)

    def _free(self, table: BlockTable) -> None:
        self.store.manager.free(table)

    def prefill(self, table: BlockTable, ids: list[int], start: int, want_last: bool = True) -> torch.Tensor | None:
        """Run `ids` at positions start.. in chunks; the table must already hold their slots."""
        out = None
        for at in range(0, len(ids), self.chunk):
            piece = ids[at : at + self.chunk]
            last = at + self.chunk >= len(ids)
            (out,) = self.runner.execute([Work(table, piece, start + at, "last" if last and want_last else "none")])
        return out

    def decode(self, table: BlockTable, logits: torch.Tensor, max_tokens: int) -> tuple[list[int], int]:
        """Greedy decode from the decision point; returns (tokens, forward tokens spent)."""
        tokens: list[int] = []
        spent = 0
        while True:
            token = int(torch.argmax(logits))
            if token in self.eos:
                break
            tokens.append(token)
            if len(tokens) >= max_tokens:
                break
            pos = table.num_tokens
            self._grow(table, 1)
            (logits,) = self.runner.execute([Work(table, [token], pos, "last")])
            spent += 1
        return tokens, spent

    def finish(self, table: BlockTable, logits: torch.Tensor, max_tokens: int,
               gate: Gate | None) -> tuple[str, list[int], int, dict[str, float] | None]:
        """The engine's stopping rule: a choice question ends at its first token (the gate's best
        choice); anything else decodes greedily. Returns (text, tokens, tokens spent, choice probs)."""
        if gate is not None and gate.choices:
            d = gate.decide(logits)
            return str(d.answer), [d.token_id], 0, d.probs
        tokens, spent = self.decode(table, logits, max_tokens)
        return self._text(tokens), tokens, spent, None

    def _text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True).strip()


class Stateless(_RunnerBaseline):
    name = "stateless"

    def answer(self, context_ids: list[int], question_ids: list[int], max_tokens: int,
               gate: Gate | None = None) -> BaselineAnswer:
        t0 = time.perf_counter()
        answer = self._on_core(self._answer, context_ids, question_ids, max_tokens, gate)
        answer.ms = (time.perf_counter() - t0) * 1000
        return answer

    def _answer(self, context_ids: list[int], question_ids: list[int], max_tokens: int,
                gate: Gate | None) -> BaselineAnswer:
        t0 = time.perf_counter()
        ids = list(context_ids) + list(question_ids)
        table = BlockTable()
        try:
            self._grow(table, len(ids))
            logits = self.prefill(table, ids, 0)
            assert logits is not None
            first = logits.clone()
            text, tokens, spent, probs = self.finish(table, logits, max_tokens, gate)
        finally:
            self._free(table)
        return BaselineAnswer(text, tokens, (time.perf_counter() - t0) * 1000, len(ids) + spent, first, probs)


class PrefixCache(_RunnerBaseline):
    """One cached table per session: the context of its previous question, reused by token match."""

    name = "prefixcache"

    def __init__(self, engine, chunk: int = 512) -> None:
        super().__init__(engine, chunk)
        self.cached: dict[str, tuple[BlockTable, list[int]]] = {}

    def adopt(self, session: str, table: BlockTable, ids: list[int]) -> None:
        """Start the cache from KV already computed for `ids` (a fork of `table`, blocks shared).

        The cells hold exactly what this cache would have computed for the same ids on the
        same model, so a sweep can skip re-paying a catch-up it would only pay once.
        """
        self.drop(session)
        fork = self._on_core(self.store.fork, table, len(ids))
        self.cached[session] = (fork, list(ids))

    def answer(self, session: str, context_ids: list[int], question_ids: list[int],
               max_tokens: int, gate: Gate | None = None) -> BaselineAnswer:
        t0 = time.perf_counter()
        answer = self._on_core(self._answer, session, context_ids, question_ids, max_tokens, gate)
        answer.ms = (time.perf_counter() - t0) * 1000
        return answer

    def catch_up(self, session: str, context_ids: list[int]) -> int:
        """Extend the session's cached table to `context_ids` without a question (tokens computed)."""
        return self._on_core(self._extend, session, context_ids)

    def _extend(self, session: str, context_ids: list[int]) -> int:
        table, have = self.cached.get(session, (BlockTable(), []))
        keep = common_prefix(have, context_ids)
        if keep < table.num_tokens:
            self.store.truncate(table, keep)
        new = context_ids[keep:]
        if new:
            self._grow(table, len(new))
            self.prefill(table, new, keep, want_last=False)
        self.cached[session] = (table, list(context_ids))
        return len(new)

    def _answer(self, session: str, context_ids: list[int], question_ids: list[int],
                max_tokens: int, gate: Gate | None) -> BaselineAnswer:
        t0 = time.perf_counter()
        new = self._extend(session, context_ids)
        table = self.cached[session][0]
        branch = self.store.fork(table, len(context_ids))
        try:
            self._grow(branch, len(question_ids))
            logits = self.prefill(branch, list(question_ids), len(context_ids))
            assert logits is not None
            first = logits.clone()
            text, tokens, spent, probs = self.finish(branch, logits, max_tokens, gate)
        finally:
            self._free(branch)
        return BaselineAnswer(text, tokens, (time.perf_counter() - t0) * 1000,
                              new + len(question_ids) + spent, first, probs)

    def drop(self, session: str) -> None:
        entry = self.cached.pop(session, None)
        if entry is not None:
            self._on_core(self._free, entry[0])

    def close(self) -> None:
        for session in list(self.cached):
            self.drop(session)


class Peer:
    """An OpenAI-compatible completion server, sent the same chat-layout prompt as text.

    Choice questions ask for one token with its top alternatives (`logprobs`, and llama-server's
    `n_probs`) and take the best choice among them: the same first-token rule as the engine.
    """

    name = "peer"
    top_n = 20

    def __init__(self, url: str, tokenizer, timeout_s: float = 300.0) -> None:
        self.base = url.rstrip("/")
        self.url = self.base + "/v1/completions"
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s

    def request(self, prompt: str, max_tokens: int, gate: Gate | None = None) -> dict:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "cache_prompt": True,
                "stream": False}
        if gate is not None and gate.choices:
            body.update(max_tokens=1, logprobs=self.top_n, n_probs=self.top_n)
        return body

    def complete(self, prompt: str, max_tokens: int, **extra: Any) -> tuple[float, dict]:
        """One greedy completion of `prompt` (text, tokenized by the server): (wall ms, its reply). `extra`:
        more fields of the request (llama-server's `id_slot`)."""
        body = {**self.request(prompt, max_tokens), **extra}
        t0 = time.perf_counter()
        reply = self._post(self.url, body)
        return (time.perf_counter() - t0) * 1000, reply

    def prompt(self, context_ids: list[int], question_ids: list[int]) -> str:
        # The server tokenizes the text itself; our ids decode to exactly this prompt.
        return self.tokenizer.decode(list(context_ids) + list(question_ids), skip_special_tokens=False)

    def _post(self, url: str, body: dict) -> dict:
        req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            return json.loads(resp.read())

    def tokens_match(self, ids: list[int]) -> bool | None:
        """Whether the server tokenizes our prompt text back to our ids (None: no /tokenize endpoint)."""
        try:
            reply = self._post(self.base + "/tokenize", {"content": self.prompt(ids, []), "add_special": False})
        except Exception:  # not llama-server: the check is unavailable, not failed
            return None
        theirs = [t if isinstance(t, int) else t.get("id") for t in reply.get("tokens", [])]
        return theirs == list(ids)

    def answer(self, context_ids: list[int], question_ids: list[int], max_tokens: int,
               gate: Gate | None = None) -> BaselineAnswer:
        body = self.request(self.prompt(context_ids, question_ids), max_tokens, gate)
        t0 = time.perf_counter()
        reply = self._post(self.url, body)
        choice = reply["choices"][0]
        text = choice.get("text", "")
        probs = None
        if gate is not None and gate.choices:
            text, probs = self._best_choice(gate, choice, text)
        ms = (time.perf_counter() - t0) * 1000
        usage = reply.get("usage") or {}
        timings = reply.get("timings") or {}  # llama-server: prompt_n = tokens it did not find cached
        computed = int(timings.get("prompt_n", usage.get("prompt_tokens", 0))) + int(
            usage.get("completion_tokens", 0))
        return BaselineAnswer(text.strip(), [], ms, computed, None, probs)

    def _best_choice(self, gate: Gate, choice: dict, text: str) -> tuple[str, dict[str, float] | None]:
        """The best-scoring choice among the first token's alternatives (ids when given, else text)."""
        alternatives = top_alternatives(choice)
        by_id = {t: gate.choices[o] for t, o in zip(gate.candidate_list, gate.candidate_owner, strict=True)}
        by_text = {self.tokenizer.decode([t]): c for t, c in by_id.items()}
        best: dict[str, float] = {}
        for token_id, token, logprob in alternatives:
            owner = by_id.get(token_id) if token_id is not None else by_text.get(token)
            if owner is not None and logprob > best.get(owner, float("-inf")):
                best[owner] = logprob
        if best:
            top = max(best.values())
            weights = {c: math.exp(lp - top) for c, lp in best.items()}
            total = sum(weights.values())
            return max(best, key=best.__getitem__), {c: w / total for c, w in weights.items()}
        named = match_choice(text, gate.choices)  # no alternatives came back: the text decides
        return (named or text), None


def top_alternatives(choice: dict) -> list[tuple[int | None, str, float]]:
    """(token id or None, token text, logprob) of the first generated token's top alternatives,
    from llama-server's `logprobs.content[0].top_logprobs`, OpenAI's `logprobs.top_logprobs[0]`
    or llama-server's native `completion_probabilities`."""
    lp = choice.get("logprobs") or {}
    content = lp.get("content") if isinstance(lp, dict) else None
    if content:
        return [(t.get("id"), t.get("token", ""), float(t["logprob"])) for t in content[0].get("top_logprobs", [])]
    if isinstance(lp, dict) and lp.get("top_logprobs"):
        return [(None, tok, float(v)) for tok, v in lp["top_logprobs"][0].items()]
    probs = choice.get("completion_probabilities") or []
    if probs:
        return [(t.get("id"), t.get("tok_str", t.get("token", "")), math.log(max(float(t.get("prob", 0)), 1e-30)))
                for t in probs[0].get("probs", probs[0].get("top_probs", []))]
    return []
