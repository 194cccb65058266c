"""calibrate's samples as rows: written by `--samples FILE`, read back by `--from-samples FILE`.

One row per sample: question, range, bar, gap, answer, truth, correct, live_fired. A replay
is minutes to hours of model time; what a gate does with its answers is not. The answers do
not depend on the gate (calibrate reads the gate's gap and answer, never its verdict), so a
file of them can be judged again at another target precision or auto_confidence in seconds,
with the same report, JSON and intervals as the replay that wrote it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from streamllm.config import QuestionSpec
from streamllm.evaluation.report import CalibrationRun, QuestionRecord, QuestionReport

COLUMNS = ("question", "range", "bar", "gap", "answer", "truth")  # what a re-judgement reads
MODEL = "(recorded samples)"


class SamplesError(ValueError):
    """A samples file that cannot be judged: unreadable, missing columns, bad rows, unknown questions."""


def write_samples(records: Sequence[QuestionRecord], reports: Sequence[QuestionReport], path: Path) -> int:
    """Every sample as a row (question, range, bar, gap, answer, truth, correct, live_fired: the reports'
    live gate): CSV, or Parquet for a .parquet path, for a look of one's own (polars, pandas, a
    spreadsheet) or a later `--from-samples`. Returns rows."""
    import polars as pl

    frames = [pl.DataFrame({
        "question": [r.spec.id] * len(r.gaps), "range": r.ranges or [0] * len(r.gaps),
        "bar": r.bars or list(range(len(r.gaps))), "gap": r.gaps, "answer": r.answers, "truth": r.truths,
        "correct": r.correct, "live_fired": list(report.live.fires)},
        schema={"question": pl.String, "range": pl.Int64, "bar": pl.Int64, "gap": pl.Float64, "answer": pl.String,
                "truth": pl.String, "correct": pl.Boolean, "live_fired": pl.Boolean})
        for r, report in zip(records, reports, strict=True)]
    table = pl.concat(frames) if frames else pl.DataFrame()
    if path.suffix == ".parquet":
        table.write_parquet(path)
    else:
        table.write_csv(path)
    return table.height


def read_samples(path: Path, session: str, questions: Sequence[QuestionSpec]) -> CalibrationRun:
    """The samples of `questions` (a session's labelled ones) from a file `write_samples` wrote, each
    question's rows in file order (its replay order). Every row is checked before any is used."""
    import polars as pl

    if not path.is_file():
        raise SamplesError(f"samples file {path} does not exist")
    try:
        if path.suffix == ".parquet":
            table = pl.read_parquet(path)
        else:
            table = pl.read_csv(path, schema_overrides={"question": pl.String, "answer": pl.String,
                                                        "truth": pl.String})
    except Exception as exc:  # polars raises its own kinds per format; all mean "not a samples table"
        raise SamplesError(f"{path}: not a readable samples table ({type(exc).__name__}: {exc})") from None
    missing = [c for c in COLUMNS if c not in table.columns]
    if missing:
        raise SamplesError(f"{path}: no column {', '.join(missing)} (a samples file has {', '.join(COLUMNS)}; "
                           "`calibrate --samples FILE` writes one)")
    try:
        table = table.select(pl.col("question", "answer", "truth").cast(pl.String),
                             pl.col("range", "bar").cast(pl.Int64), pl.col("gap").cast(pl.Float64))
    except pl.exceptions.PolarsError as exc:
        raise SamplesError(f"{path}: range and bar must be integers and gap a number ({exc})") from None
    for column in COLUMNS:
        unusable = pl.col(column).is_null() | (~pl.col(column).is_finite() if column == "gap" else False)
        bad = table.with_row_index("row").filter(unusable)
        if bad.height:
            row = bad["row"][0] + 1
            raise SamplesError(f"{path}: data row {row}: {column} is empty or not a finite value "
                               f"({bad.height} such rows)")
    known = {q.id: q for q in questions}
    unknown = sorted(set(table["question"]) - set(known))
    if unknown:
        raise SamplesError(f"{path}: question {', '.join(map(repr, unknown))} is not a labelled question of "
                           f"session {session!r} ({', '.join(known) or 'none'}); pass the config that wrote it")
    records = []
    for question in questions:
        mine = table.filter(pl.col("question") == question.id)
        if mine.height == 0:
            continue
        choices = {c.casefold() for c in question.choices}
        for column in ("answer", "truth"):
            stray = sorted({v for v in mine[column] if choices and v.casefold() not in choices})
            if stray:
                raise SamplesError(f"{path}: question {question.id!r}: {column} {stray[0]!r} is not one of its "
                                   f"choices {list(question.choices)}")
        records.append(QuestionRecord(question, mine["gap"].to_list(), mine["answer"].to_list(),
                                      mine["truth"].to_list(), mine["bar"].to_list(), mine["range"].to_list()))
    if not records:
        raise SamplesError(f"{path}: no samples")
    updates = table.select("range", "bar").unique().height
    return CalibrationRun(session, MODEL, updates, 0, updates, 0, 0.0, records)
