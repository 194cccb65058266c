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

All three answer greedily up to the question's max_tokens (or end of turn) and time
the whole answer. The runner's cells come from the engine's pool, so allocation takes
the engine's lock; call these while the engine is idle, or they compete for the CPU.
"""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass

import torch

from streamllm.engine.kv import BlockTable
from streamllm.engine.runner import Work


@dataclass(slots=True)
class BaselineAnswer:
    text: str
    tokens: list[int]
    ms: float
    tokens_computed: int  # prefill + decode tokens this answer ran through the model
    first_logits: torch.Tensor | None = None  # the decision-point distribution


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

    def _text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True).strip()


class Stateless(_RunnerBaseline):
    name = "stateless"

    def answer(self, context_ids: list[int], question_ids: list[int], max_tokens: int) -> BaselineAnswer:
        t0 = time.perf_counter()
        answer = self._on_core(self._answer, context_ids, question_ids, max_tokens)
        answer.ms = (time.perf_counter() - t0) * 1000
        return answer

    def _answer(self, context_ids: list[int], question_ids: list[int], max_tokens: int) -> BaselineAnswer:
        t0 = time.perf_counter()
        ids = list(context_ids) + list(question_ids)
        table = BlockTable()
        try:
            self._grow(table, len(ids))
            logits = self.prefill(table, ids, 0)
            assert logits is not None
            first = logits.clone()
            tokens, spent = self.decode(table, logits, max_tokens)
        finally:
            self._free(table)
        return BaselineAnswer(self._text(tokens), tokens, (time.perf_counter() - t0) * 1000, len(ids) + spent, first)


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
               max_tokens: int) -> BaselineAnswer:
        t0 = time.perf_counter()
        answer = self._on_core(self._answer, session, context_ids, question_ids, max_tokens)
        answer.ms = (time.perf_counter() - t0) * 1000
        return answer

    def _answer(self, session: str, context_ids: list[int], question_ids: list[int],
                max_tokens: int) -> BaselineAnswer:
        t0 = time.perf_counter()
        table, have = self.cached.get(session, (BlockTable(), []))
        keep = common_prefix(have, context_ids)
        if keep < table.num_tokens:
            self.store.truncate(table, keep)
        new = context_ids[keep:]
        if new:
            self._grow(table, len(new))
            self.prefill(table, new, keep, want_last=False)
        self.cached[session] = (table, list(context_ids))
        branch = self.store.fork(table, len(context_ids))
        try:
            self._grow(branch, len(question_ids))
            logits = self.prefill(branch, list(question_ids), len(context_ids))
            assert logits is not None
            first = logits.clone()
            tokens, spent = self.decode(branch, logits, max_tokens)
        finally:
            self._free(branch)
        return BaselineAnswer(self._text(tokens), tokens, (time.perf_counter() - t0) * 1000,
                              len(new) + len(question_ids) + spent, first)

    def drop(self, session: str) -> None:
        entry = self.cached.pop(session, None)
        if entry is not None:
            self._on_core(self._free, entry[0])

    def close(self) -> None:
        for session in list(self.cached):
            self.drop(session)


class Peer:
    """An OpenAI-compatible completion server, sent the same chat-layout prompt as text."""

    name = "peer"

    def __init__(self, url: str, tokenizer, timeout_s: float = 300.0) -> None:
        self.url = url.rstrip("/") + "/v1/completions"
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s

    def request(self, prompt: str, max_tokens: int) -> dict:
        return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "cache_prompt": True,
                "stream": False}

    def answer(self, context_ids: list[int], question_ids: list[int], max_tokens: int) -> BaselineAnswer:
        # The server tokenizes the text itself; our ids decode to exactly this prompt.
        prompt = self.tokenizer.decode(list(context_ids) + list(question_ids), skip_special_tokens=False)
        body = json.dumps(self.request(prompt, max_tokens)).encode()
        req = urllib.request.Request(self.url, body, {"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            reply = json.loads(resp.read())
        ms = (time.perf_counter() - t0) * 1000
        text = reply["choices"][0].get("text", "")
        usage = reply.get("usage") or {}
        timings = reply.get("timings") or {}  # llama-server: prompt_n = tokens it did not find cached
        computed = int(timings.get("prompt_n", usage.get("prompt_tokens", 0))) + int(
            usage.get("completion_tokens", 0))
        return BaselineAnswer(text.strip(), [], ms, computed)
