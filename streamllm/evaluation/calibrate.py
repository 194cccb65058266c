"""`streamllm calibrate`: replay recorded bars, measure each labelled question's gate.

For every bar pushed into the session (one update each), once the standing entries
are fresh, every labelled question contributes one sample: the gate's gap and fast
answer from the entry's ready distribution, and the truth of its label on the bars
so far (unknown while the label lacks history: skipped). Per question that yields
the risk-coverage curve and the smallest threshold whose fired answers reach the
target precision, or none: a small model may never get there, and then it says so.

    warmup bars (one batch) | bar | bar | ...  each bar: push -> wait_idle -> read gates

The measures, the JSON, the table and the plot: evaluation/report.py.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from feeds.sources import read_options
from streamllm.config import QuestionSpec, SessionSpec, load_config
from streamllm.engine import Engine, EngineConfig
from streamllm.engine.compaction import CompactionPolicy
from streamllm.engine.prompt import PromptLayout
from streamllm.evaluation.report import (
    CalibrationRun,
    QuestionRecord,
    QuestionReport,
    summarize,
)
from streamllm.evaluation.samples import SamplesError, read_samples
from streamllm.feeding.render import Renderer
from streamllm.model.adapter import AdapterError, pick_adapter
from streamllm.model.loader import load_model
from streamllm.tuning.data import describe, load_bars, time_range

if TYPE_CHECKING:
    import argparse

DEFAULT_BARS = 200  # ~4,800 context tokens and a few minutes on 2 CPU cores with the 135M model
ESTIMATE_AFTER = 5  # updates timed before the run-time estimate is printed
ENTRY_SLACK_BLOCKS = 2  # an entry copies its fork's partial tail block and may end in a new one


class CalibrationError(ValueError):
    """A run that cannot start or go on: bad config, data, budget or arguments."""


# -- replay ----------------------------------------------------------------------------


def labelled_questions(spec: SessionSpec) -> list[QuestionSpec]:
    return [q for q in spec.questions if q.label is not None]


def bars_that_fit(prefix_tokens: int, line_tokens: Sequence[int], max_context: int) -> int:
    used, fit = prefix_tokens, 0
    for n in line_tokens:
        if used + n > max_context:
            break
        used, fit = used + n, fit + 1
    return fit


def replay(engine: Any, spec: SessionSpec, bars: Sequence[Any], lines: Sequence[str], *, warmup: int,
           progress: bool = True, log=print) -> CalibrationRun:
    """Push `lines` (one per bar of `bars`) into a fresh session and record every labelled gate."""
    from tqdm import tqdm

    questions = labelled_questions(spec)
    engine.open_session(spec.name, system=spec.system_prompt, max_context=spec.max_context_tokens)
    for q in questions:
        # push=False: calibration reads the gate alone; no standing-answer decodes to pay for.
        engine.register(spec.name, dataclasses.replace(q, push=False))
    records = [QuestionRecord(q) for q in questions]
    history = max(q.label.bars_needed for q in questions)
    run = CalibrationRun(spec.name, engine.model_name, warmup, warmup, 0, 0, 0.0, records)
    start = time.perf_counter()
    if warmup:
        engine.push(spec.name, list(lines[:warmup]))  # one batch: the entries are computed once for it
        engine.wait_idle()
    bar = tqdm(total=len(bars) - warmup, desc="replay", unit="bar", disable=not progress, leave=False)
    t_first = time.perf_counter()
    try:
        for i in range(warmup, len(bars)):
            ack = engine.push(spec.name, [lines[i]])
            engine.wait_idle()
            window = bars[max(0, i + 1 - history): i + 1]
            for record in records:
                st = engine.prepos.find(spec.name, record.spec.id)
                if st is None or st.ready is None or st.ready.data_version != ack.data_version:
                    raise RuntimeError(f"question {record.spec.id!r} has no entry at data version "
                                       f"{ack.data_version} after wait_idle (entries evicted for lack of cells?)")
                truth = record.spec.expected_answer(window)
                if truth is None:
                    record.unknown += 1
                    continue
                decision = engine.prepos.decide(st)  # the head's, when an adapter trained one
                record.gaps.append(decision.gap)
                record.answers.append(decision.answer)
                record.truths.append(truth)
                record.bars.append(i)
            run.bars, run.updates = i + 1, run.updates + 1
            if run.updates == ESTIMATE_AFTER and len(bars) - i > 1:
                each = (time.perf_counter() - t_first) / ESTIMATE_AFTER
                bar.write(f"the first {ESTIMATE_AFTER} updates took {each:.2f}s each: ~{each * (len(bars) - i - 1) / 60:.1f}"
                          f" min for the remaining {len(bars) - i - 1} bars at that rate (later updates read a "
                          "longer context and take longer; the progress bar shows the live ETA)")
            bar.update()
    finally:
        bar.close()
        run.seconds = time.perf_counter() - start
        run.context_tokens = engine.session_info(spec.name).num_tokens
    return run


def _pick_session(config: Any, name: str | None) -> SessionSpec:
    if name is not None:
        try:
            spec = config.session(name)
        except KeyError as exc:
            raise CalibrationError(str(exc.args[0])) from None
    else:
        spec = next((s for s in config.sessions if labelled_questions(s)), config.sessions[0])
    if not labelled_questions(spec):
        raise CalibrationError(f"{config.source}: session {spec.name!r} has no labelled questions; add "
                               "`label = \"trend_up(n=10)\"` (see docs/questions.md) to calibrate")
    return spec


def _one_instrument(sources: dict[str, list[Any]], spec: SessionSpec, path: Path) -> tuple[str, list[Any]]:
    """The source calibration replays (name, bars): the file's only instrument, or the session's among several."""
    mine = list(sources) if len(sources) == 1 else [n for n in sources if n.rpartition(":")[2] == spec.instrument]
    if len(mine) == 1:
        return mine[0], sources[mine[0]]
    raise CalibrationError(f"{path} holds {', '.join(sorted(sources))}; calibration replays one instrument and "
                           f"the session's {spec.instrument!r} is not one of them (set the session's instrument)")


def _data_path(spec: SessionSpec, data: str | None) -> tuple[str, Path]:
    """--data as given (PATH, or PATH@FROM..TO: the bars opening in that time range) and its file."""
    if data is not None:
        try:
            path = Path(time_range(data)[0])
        except ValueError as exc:
            raise CalibrationError(str(exc)) from None
    elif spec.feed.path is not None and spec.feed.kind == "csv":
        path = spec.feed.path
        data = str(path)
    else:
        raise CalibrationError(f"session {spec.name!r} has feed {spec.feed}; pass --data BARS.csv")
    if not path.is_file():
        raise CalibrationError(f"data file {path} does not exist")
    return data, path


def calibrate(args: argparse.Namespace, model: Any = None) -> tuple[CalibrationRun, list[QuestionReport], dict]:
    """Run the whole calibration; returns the run, per-question reports and the JSON's run metadata."""
    if not 0 < args.target_precision <= 1:
        raise CalibrationError(f"--target-precision must be in (0, 1], got {args.target_precision}")
    if args.auto_confidence is not None and not 0.5 <= args.auto_confidence < 1:
        raise CalibrationError(f"--auto-confidence must be in [0.5, 1), got {args.auto_confidence}")
    config = load_config(args.questions)
    spec = _pick_session(config, args.session)
    if args.from_samples is not None:
        return _from_samples(args, spec)
    data, path = _data_path(spec, args.data)
    if spec.render.mode != "bars":
        raise CalibrationError(f"session {spec.name!r} renders {spec.render.mode!r}; calibration replays bars")
    try:  # as every command reads files: bar tables, DBN OHLCV at their own interval; trades as session bars
        sources = load_bars([data], opts=read_options(args, instrument=spec.instrument),
                            bar_seconds=float(spec.render.bar_seconds or 60))
    except ValueError as exc:
        raise CalibrationError(str(exc)) from None
    name, bars = _one_instrument(sources, spec, path)
    print(f"streamllm calibrate: session {spec.name}: {describe(name, bars)}", file=sys.stderr)
    if not bars:
        raise CalibrationError(f"{path}: no usable bars")
    spec, no_volume = _without_volume_questions(spec, bars, path)
    starts = args.start
    for start in starts:
        if not 0 <= start < len(bars):
            raise CalibrationError(f"--start {start} is outside the file's {len(bars)} bars")
    warmups = [_warmup(args, spec, bars[start:]) for start in starts]  # every range checked before the model loads
    unlabelled = [q.id for q in spec.questions if q.label is None]
    if unlabelled:
        print(f"streamllm calibrate: left out, having no label to judge them by: {', '.join(unlabelled)} "
              "(add `label = \"trend_up(n=10)\"`, docs/questions.md)", file=sys.stderr)
    loaded = model if model is not None else load_model(args.model, progress=True)
    try:  # as serve would: --adapter, else the config's heads when they fit the model
        chosen = None if args.no_adapter else pick_adapter(args.adapter, config.adapter, loaded.name,
                                                           warn=lambda m: print(m, file=sys.stderr), config=config)
    except AdapterError as exc:
        raise CalibrationError(str(exc)) from None
    adapter = None if chosen is None else str(chosen.path)
    # Every range's bars rendered and fitted to the context before any replay: a range that cannot fit
    # is refused now, not after the ranges before it have run.
    plans = [_plan_range(args, config, spec, loaded, bars[start:], warmup, start if len(starts) > 1 else None)
             for start, warmup in zip(starts, warmups, strict=True)]
    runs = []
    for k, (start, plan) in enumerate(zip(starts, plans, strict=True)):
        if len(starts) > 1:
            print(f"range {k + 1} of {len(starts)}: bars from {start}")
        run, adapter_id = _replay_range(spec, loaded, adapter, plan, progress=not args.no_progress)
        runs.append(run)
    run = runs[0] if len(runs) == 1 else pool(runs)
    meta = {"config": str(args.questions), "data": data, "target_precision": args.target_precision,
            "start": starts[0] if len(starts) == 1 else starts, "adapter": adapter, "adapter_id": adapter_id,
            "left_out_no_label": unlabelled, "left_out_no_volume": no_volume, "without_head": _without_head(spec, chosen)}
    return run, [summarize(r, args.target_precision, args.auto_confidence) for r in run.records], meta


def _without_volume_questions(spec: SessionSpec, bars: Sequence[Any], path: Path) -> tuple[SessionSpec, list[str]]:
    """Bars of a table with no volume (NaN: FX brokers' OHLC) cannot answer a label that reads volume: those
    questions are left out, by name, and the rest calibrated; none left is an error."""
    if not all(b.volume != b.volume for b in bars):
        return spec, []
    # A label reads volume when its expression does (LabelSpec.reads_volume, fixed at parse time);
    # tests/test_calibrate.py checks that every other label answers alike whatever the volume is.
    out = [q.id for q in labelled_questions(spec) if q.label.reads_volume]
    if not out:
        return spec, []
    print(f"streamllm calibrate: {path} has no volume: {', '.join(out)} cannot be answered (their labels read "
          "volume); left out", file=sys.stderr)
    kept = tuple(q for q in spec.questions if q.id not in out)
    spec = dataclasses.replace(spec, questions=kept)
    if not labelled_questions(spec):
        raise CalibrationError(f"{path} has no volume column and every labelled question of session {spec.name!r} "
                               f"reads volume ({', '.join(out)}): nothing to calibrate on these bars")
    return spec, out


def _without_head(spec: SessionSpec, adapter: Any) -> list[str]:
    """Labelled questions no choice head of the adapter decides (the untuned model's logits do): all of
    them without an adapter. The config-wide minimum coverage counts them too."""
    return [q.id for q in labelled_questions(spec)
            if adapter is None or adapter.head_for(q.text, tuple(q.choices or ())) is None]


REPLAY_ONLY = ("data", "bars", "warmup", "adapter", "no_adapter")


def _from_samples(args: argparse.Namespace, spec: SessionSpec) -> tuple[CalibrationRun, list, dict]:
    """A replay's recorded samples judged again: the questions (labels, choices, auto_confidence) from
    the config, the answers from the file; nothing is replayed, so replay options are refused."""
    given = [f"--{name.replace('_', '-')}" for name in REPLAY_ONLY if getattr(args, name) not in (None, False)]
    if args.start != [0]:
        given.append("--start")
    if given:
        raise CalibrationError(f"--from-samples judges recorded answers; {', '.join(given)} only apply to a replay")
    try:
        run = read_samples(args.from_samples, spec.name, labelled_questions(spec))
    except SamplesError as exc:
        raise CalibrationError(str(exc)) from None
    ranges = sorted({k for r in run.records for k in r.ranges})
    meta = {"config": str(args.questions), "from_samples": str(args.from_samples),
            "target_precision": args.target_precision, "start": ranges if len(ranges) > 1 else 0,
            "left_out_no_label": [q.id for q in spec.questions if q.label is None]}
    return run, [summarize(r, args.target_precision, args.auto_confidence) for r in run.records], meta


def pool(runs: Sequence[CalibrationRun]) -> CalibrationRun:
    """Several ranges' replays as one run: each question's samples end to end (one threshold for all),
    each marked with its range so that no interval block spans two."""
    records = [QuestionRecord(rs[0].spec) for rs in zip(*(r.records for r in runs), strict=True)]
    for k, r in enumerate(runs):
        for into, rec in zip(records, r.records, strict=True):
            into.gaps += rec.gaps
            into.answers += rec.answers
            into.truths += rec.truths
            into.bars += rec.bars
            into.ranges += [k] * len(rec.bars)
            into.unknown += rec.unknown
    return CalibrationRun(runs[0].session, runs[0].model, sum(r.bars for r in runs), sum(r.warmup for r in runs),
                          sum(r.updates for r in runs), max(r.context_tokens for r in runs),
                          sum(r.seconds for r in runs), records)


def _warmup(args: argparse.Namespace, spec: SessionSpec, bars: list[Any]) -> int:
    """Bars pushed before recording, checked against a range's bars (before any model is loaded)."""
    warmup = max(q.label.bars_needed for q in labelled_questions(spec)) - 1 if args.warmup is None else args.warmup
    if args.bars is not None and args.bars < 1:
        raise CalibrationError(f"--bars must be at least 1, got {args.bars}")
    if not 0 <= warmup < min(len(bars), args.bars or len(bars)):
        raise CalibrationError(f"--warmup {warmup} leaves no bars to record (of {min(len(bars), args.bars or len(bars))})")
    return warmup


@dataclasses.dataclass(slots=True)
class RangePlan:
    """One range, rendered and fitted to the session's context before any replay."""

    bars: list[Any]  # the range's bars to replay, warmup included
    lines: list[str]
    warmup: int


def _plan_range(args: argparse.Namespace, config: Any, spec: SessionSpec, loaded: Any, bars: list[Any],
                warmup: int, start: int | None) -> RangePlan:
    """A range from its first bar, --bars of them (warmup included), or the CalibrationError that says
    why it cannot fit the session's context (naming the range when there are several)."""
    questions = labelled_questions(spec)
    layout = PromptLayout(loaded.tokenizer)
    renderer = Renderer(changes=spec.render.changes)
    # Nothing beyond max_context lines can fit (a line is at least one token): render no more.
    candidates = bars[: min(len(bars), spec.max_context_tokens, args.bars or len(bars))]
    lines = [renderer.render(b) for b in candidates]
    line_tokens = [len(ids) for ids in layout.lines_ids(lines)]
    prefix = len(layout.prefix_ids(spec.system_prompt))
    fit = bars_that_fit(prefix, line_tokens, spec.max_context_tokens)
    where = "" if start is None else f"range --start {start}: "
    if args.bars is None:
        count = min(DEFAULT_BARS, fit, len(bars))
        print(f"{where}replaying the first {count} of {len(bars)} bars (default; --bars N to change, "
              f"the session's max_context_tokens {spec.max_context_tokens} holds about {fit})")
    elif min(args.bars, len(bars)) > fit:
        need = prefix + sum(line_tokens[: args.bars])
        raise CalibrationError(
            f"{where}--bars {args.bars} needs {need if args.bars <= len(line_tokens) else 'more than ' + str(need)} "
            f"context tokens; session {spec.name!r} has max_context_tokens {spec.max_context_tokens} "
            f"(fits {fit} bars): lower --bars or raise max_context_tokens in {config.source}")
    else:
        count = min(args.bars, len(bars))
    if warmup >= count:
        raise CalibrationError(f"{where}--warmup {warmup} leaves no bars to record (of {count} that fit)")
    entry_tokens = [len(layout.question_ids(q.text)) for q in questions]
    per_bar = sum(line_tokens[:count]) / count
    print(f"{where}session {spec.name!r}: {len(questions)} labelled questions, {count} bars x ~{per_bar:.0f} tokens "
          f"= {prefix + sum(line_tokens[:count])} of {spec.max_context_tokens} context tokens; each update "
          f"prefills ~{per_bar:.0f} + {sum(entry_tokens)} entry tokens; warmup {warmup} bars")
    return RangePlan(bars[:count], lines[:count], warmup)


def _replay_range(spec: SessionSpec, loaded: Any, adapter: str | None, plan: RangePlan,
                  progress: bool) -> tuple[CalibrationRun, str | None]:
    """One planned range's replay in a fresh engine; the run and the adapter id the engine loaded."""
    questions = labelled_questions(spec)
    layout = PromptLayout(loaded.tokenizer)
    entry_tokens = [len(layout.question_ids(q.text)) for q in questions]
    block = 16
    # Each question holds up to two entries (ready + computing), each its question plus copied tail
    # blocks; doubled, since an entry that cannot get cells is retried and wait_idle would never return.
    branch_cells = 2 * block * sum(2 * (-(-n // block) + ENTRY_SLACK_BLOCKS) for n in entry_tokens)
    # Admission also keeps room for one compaction copy of the session (the engine's own rule).
    keep_free = CompactionPolicy().keep_free(branch_cells, spec.max_context_tokens)
    try:
        engine = Engine(loaded, EngineConfig(max_cells=spec.max_context_tokens + keep_free + block, block_size=block,
                                             max_context=spec.max_context_tokens, branch_cells=branch_cells),
                        adapter=adapter)
    except AdapterError as exc:
        raise CalibrationError(str(exc)) from None
    try:
        run = replay(engine, spec, plan.bars, plan.lines, warmup=plan.warmup, progress=progress)
    finally:
        engine.shutdown()
    return run, engine.adapter_id
