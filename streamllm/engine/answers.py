"""How the core turns questions and logits into answers (runs on the core thread only).

    ask ─┬─ standing, entry current ──▶ answer from the entry: gate fired → fast; a choice
         │                               question → its best choice; else decode from the entry
         ├─ standing, entry coming ───▶ waits on the Standing, answered when the entry lands
         └─ ad hoc / no entry ────────▶ waiting → forked at its data version → prefill → decode

A question with choices is always answered with one of them: the gate rejects choices
whose first tokens collide at registration, so the first token (scored over each
choice's spellings) names the choice on every path, and no free decode can wander off.
"""

from __future__ import annotations

import time

import torch

from streamllm.engine.commands import Ask, settle
from streamllm.engine.kv import KVCapacityError
from streamllm.engine.outputs import Answer
from streamllm.engine.prepos import Standing
from streamllm.engine.sequence import ASK, DECODE, ENTRY, Branch


def is_final(rec, spec, max_tokens: int, eos_ids: set[int]) -> bool:
    """Whether the ready record alone answers: a choice question, or a fired gate on an answer that
    is one token long (max_tokens 1, or the top token ends the turn)."""
    if max_tokens == spec.max_tokens:
        return rec.final
    return bool(spec.choices) or (rec.fired and (max_tokens == 1 or rec.token_id in eos_ids))


class Answering:
    """The answering half of EngineCore (a base class: it shares the core's state)."""

    def _ask(self, cmd: Ask) -> None:
        session = self.session(cmd.name)
        st = self.prepos.by_session.get(cmd.name, {}).get(cmd.standing_id) if cmd.standing_id else None
        if cmd.standing_id and st is None:  # unregistered since the facade looked: ask it cold
            cmd.standing_id = None
        spec = st.spec if st is not None else None
        br = Branch(ASK, session, cmd.question, st.prompt_ids if st else cmd.prompt_ids,
                    cmd.max_tokens or (spec.max_tokens if spec else 16), list(cmd.stop), cmd.future,
                    min_version=cmd.min_version, choices=(st.gate if st and spec.choices else cmd.choices),
                    standing=st, on_text=cmd.on_text, t_start=cmd.t_start or time.perf_counter(),
                    keep_logits=cmd.keep_logits, ask_id=cmd.ask_id)
        if st is None:
            self.waiting.append(br)
            return
        br.min_version = max(br.min_version, session.data_version)
        if st.ready is not None and st.ready.data_version >= br.min_version:
            self._answer_from_entry(st, br)
        elif st.ready is not None and self.stale_policy == "stale":
            br.stale = True
            self._answer_from_entry(st, br)
        else:
            st.waiters.append(br)

    def _can_start(self, br: Branch) -> bool:
        return br.session.ready and br.session.data_version >= br.min_version

    def _start_waiting(self) -> None:
        for br in [b for b in self.waiting if self._can_start(b)]:
            s = br.session
            try:
                br.table = self._fork_evicting(s, s.version_length(s.data_version))
            except KVCapacityError as exc:
                if not self.running:  # nothing will free cells: fail instead of waiting forever
                    self.waiting.remove(br)
                    settle(br.future, error=exc)
                continue
            br.base_len = s.version_length(s.data_version)
            br.data_version = s.data_version
            self.waiting.remove(br)
            self.running.append(br)

    def _fork_evicting(self, session, length: int):
        """Fork for a question; under pressure, idle sessions' entries (recomputable) go first."""
        try:
            return self.store.fork(session.table, length)
        except KVCapacityError:
            busy = {b.session.name for b in self.running} | {session.name}
            if not self.prepos.evict_idle_entries(busy):
                raise
            self._drop_evicted_records()
            return self.store.fork(session.table, length)

    def _drop_evicted_records(self) -> None:
        for st in self.prepos.all():
            if st.record is None:
                self.ready_records.pop((st.session.name, st.spec.id), None)

    def _make_room_for_questions(self) -> None:
        """A question whose next chunk does not fit evicts idle entries; if even that cannot make
        room, it fails with a clear error instead of waiting forever."""
        manager, chunk = self.store.manager, self.scheduler.config.chunk_tokens
        for br in list(self.running):
            need = min(len(br.pending_ids), chunk)
            if need == 0 or manager.can_append(br.table, need):
                continue
            self.prepos.evict_idle_entries({b.session.name for b in self.running})
            if not manager.can_append(br.table, need):
                self.prepos.evict_idle_entries(set())
            self._drop_evicted_records()
            if manager.can_append(br.table, need) or len(self.running) > 1:
                continue  # room made, or another question will finish and free its cells
            self._drop_ask(br, KVCapacityError(
                f"question on {br.session.name!r} needs {need} more cells and the pool has "
                f"{manager.num_free_blocks * manager.block_size} free after evicting idle entries; "
                "raise max_cells or ask a shorter question"))

    def _waiters_without_entries(self) -> None:
        """Asks waiting on an entry that cannot be computed (no cells) go the cold way."""
        for st in self.prepos.all():
            if st.waiters and st.session.ready and st.computing is None and not st.fresh():
                for br in st.waiters:
                    br.standing = None
                self.waiting.extend(st.waiters)
                st.waiters.clear()

    # -- results of a step ------------------------------------------------------------
    def on_logits(self, br: Branch, logits: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        if br.kind == ENTRY:
            self._on_entry_ready(br, logits.clone(), hidden)
            return
        if br.keep_logits and br.first_logits is None:
            br.first_logits = logits.clone()
        if br.choices is not None and not br.generated:  # the first token names the choice
            d = br.choices.decide(logits)
            br.confidence, br.choice_probs = d.gap, d.probs
            br.text, br.finish_reason = d.answer, "stop"
            self._finish(br)
            return
        self._on_token(br, int(torch.argmax(logits)))

    def _on_entry_ready(self, entry: Branch, logits: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        st = self.prepos.on_entry_ready(entry, logits, hidden)
        if st is None:
            return
        self.ready_records[(st.session.name, st.spec.id)] = st.record
        waiters, st.waiters = st.waiters, []
        for br in waiters:
            if entry.data_version >= br.min_version:
                self._answer_from_entry(st, br)
            else:
                st.waiters.append(br)
        rec = st.record
        if rec.final:
            self._standing_changed(st, rec.text, "fast" if rec.fired else "entry", rec.confidence,
                                   rec.data_version, rec.choices)
        elif st.spec.push:
            self.prepos.release(st.decoding)  # an older decode is superseded by this fresher entry
            dec = Branch(DECODE, st.session, st.spec.text, st.prompt_ids, st.spec.max_tokens,
                         standing=st, confidence=rec.confidence, path="fast" if rec.fired else "entry")
            try:
                self.prepos.fork_from_entry(st, dec)
            except KVCapacityError:
                st.decoding = None
                return
            dec.prepaid = dec.num_computed
            st.decoding = dec
            self._on_token(dec, rec.token_id)
        else:  # nobody is pushed this answer: keep the gate's view (its first token, fired or not: the
            # record is not final) for snapshots and `standing`, as path "gate", never a whole answer's path
            self._standing_changed(st, rec.text, "gate", rec.confidence, rec.data_version)

    def _answer_from_entry(self, st: Standing, br: Branch) -> None:
        """Final from the gate's view (fast, or a choice question's best choice); else decode from the entry."""
        rec = st.record
        br.confidence, br.choice_probs = rec.confidence, rec.choices
        br.path = "fast" if rec.fired else "entry"
        br.data_version = rec.data_version
        if is_final(rec, st.spec, br.max_tokens, self.layout.eos_ids):
            br.first_logits = rec.logits if br.keep_logits else None
            br.finish_reason = "stop"
            self.fast_answers += rec.fired
            self.entry_answers += not rec.fired
            self.questions_answered += 1
            settle(br.future, result=self._answer(br, rec.text, 0))
            return
        try:
            self.prepos.fork_from_entry(st, br)
        except KVCapacityError as exc:
            settle(br.future, error=exc)
            return
        br.prepaid = br.num_computed
        if not br.keep_logits:
            br.first_logits = None
        self.running.append(br)
        self._on_token(br, rec.token_id)

    def _standing_changed(self, st: Standing, text: str, path: str, confidence: float, version: int,
                          choices: dict[str, float] | None = None) -> None:
        changed = self.prepos.set_answer(st, text.strip(), path, confidence, version, choices)
        self._dirty.add(st.session.name)
        if changed is not None and st.spec.push:  # push = false: kept for `standing`, told to nobody
            self.events.append((st.session.name, "standing", changed))

    def _on_token(self, br: Branch, token: int) -> None:
        if token in self.layout.eos_ids:
            br.finish_reason = "stop"
            return self._finish(br)
        br.generated.append(token)
        before = br.text
        text = self.tokenizer.decode(br.generated, skip_special_tokens=True)
        for s in br.stop:
            cut = text.find(s)
            if cut >= 0:
                br.finish_reason, br.text = "stop", text[:cut]
                self._emit(br, before)
                return self._finish(br)
        br.text = text
        self._emit(br, before)
        if len(br.generated) >= br.max_tokens:
            br.finish_reason = "length"
            self._finish(br)

    def _emit(self, br: Branch, before: str) -> None:
        if br.on_text is not None and br.text.startswith(before) and len(br.text) > len(before):
            try:
                br.on_text(br.text[len(before):])
            except Exception:  # a broken stream consumer never stops the engine
                br.on_text = None

    def _finish(self, br: Branch) -> None:
        if br.table is not None:
            self.store.manager.free(br.table)
            br.table = None
        if br.kind == DECODE:
            st: Standing = br.standing
            if st.decoding is br:
                st.decoding = None
                self._standing_changed(st, br.text, br.path, br.confidence, br.data_version)
            return
        if br in self.running:
            self.running.remove(br)
        self.questions_answered += 1
        settle(br.future, result=self._answer(br, br.text.strip(), br.num_computed - br.prepaid))

    def _answer(self, br: Branch, text: str, tokens_computed: int) -> Answer:
        latency = (time.perf_counter() - br.t_start) * 1000
        return Answer(br.session.name, br.question, text, list(br.generated), br.data_version, tokens_computed,
                      latency, path=br.path, confidence=br.confidence, stale=br.stale,
                      finish_reason=br.finish_reason, logits=br.first_logits, choices=br.choice_probs)
