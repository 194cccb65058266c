"""Live learning: a labelled choice question with no head of its own learns a series head
(streamllm/model/adapter.py) from its session's line features (engine/taps.py) as truths arrive.

The order of events is the promise (prequential evaluation):
1. an entry becomes ready at data version v: the question's current head (or the LM, before the
   first head) answers, and the learner notes which lines that answer read;
2. v's truth arrives (with v's push, or later: a forecast's) and the answer is scored
   (engine/standing/calibration.py): the live accuracy and the `auto:P` gate rest on that score;
3. only then does (v's lines, v's truth) join the training set.
A head is fitted on a copy of scored samples in the fit process (engine/standing/fit_process.py),
and swapped in by the core between steps. So no scored answer came from a head trained on its own sample:
`trained_upto` (the newest version a head was trained on) is always older than the answers it
makes, which `tests/test_live_learning.py` checks.

Only the core thread calls `Learner` and `Learning`; the fit process sees copies and returns a head.
Memory: a learner keeps at most `max_samples` samples and only the lines they read.

**The control.** Beside the head on the model's states, every fit also fits the same head on the
lines' own numbers (engine/taps.py `line_numbers`: the close, the change, h/l/v... as the line
writes them, no model). Its answers are made and scored the same way (prequential, at the same
versions) but never given: they say, in the question's figures, what the model's states add over
the raw numbers of the same K lines (`control_accuracy` beside `answer_accuracy`).

**What answers.** By default (`LearnConfig.numbers`) the answered head is the two stacked
(`stacked`): a weighed sum of the states head's and the control's logits, the weights fitted on the
newest samples neither head trained on. So an answer is never much worse than the bare numbers
would give, and the states weigh in where they carry something the numbers do not.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from streamllm.engine.standing.fit_process import submit_fit
from streamllm.engine.taps import NUMBER_WIDTH
from streamllm.model.adapter import SeriesHead, series_logits
from streamllm.model.seriesfit import Samples, SeriesFit, fit_series, lag_basis

if TYPE_CHECKING:
    from streamllm.config.labels import LabelSpec
    from streamllm.engine.standing.prepos import Standing
    from streamllm.engine.taps import LineTaps, Word

log = logging.getLogger(__name__)

MAX_WAITING = 256  # answered versions whose lines are kept until their truth comes
COMPARED = 500  # newest scored answers the control is compared on (calibration's window)


@dataclass(frozen=True, slots=True)
class LearnConfig:
    """How standing questions learn (EngineConfig.learning)."""

    enabled: bool = True  # a labelled choice question without a head learns one live
    lines: int = 16  # K: lines a learned head reads (at least)
    max_lines: int = 128  # ... and at most, for a label that looks back further (`lines_for`)
    layer: int | None = None  # the residual layer it reads; None: the adapter's, else 2/5 of the model's depth
    words: tuple[Word, ...] = (2,)  # words whose last token a line adds (without an adapter's series heads)
    every: int = 32  # scored samples between refits
    min_samples: int = 64  # scored samples before the first fit
    max_samples: int = 2000  # newest samples kept for fitting
    steps: int = 240  # optimizer steps per fit
    budget_s: float = 10.0  # CPU seconds a fit may take (it keeps its best step so far)
    rank: int = 4  # numbers a head takes from each line
    numbers: bool = True  # the head reads each line's own numbers beside its states (False: states alone)

    def __post_init__(self) -> None:
        for name in ("lines", "max_lines", "every", "min_samples", "max_samples", "steps", "rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.learning.{name} must be a positive int, got {value!r}")
        if not self.budget_s > 0:
            raise ValueError(f"EngineConfig.learning.budget_s must be > 0 seconds, got {self.budget_s!r}")
        if self.max_lines < self.lines:
            raise ValueError(f"EngineConfig.learning.max_lines ({self.max_lines}) must be >= lines ({self.lines})")
        if self.min_samples < 8:
            raise ValueError(f"EngineConfig.learning.min_samples must be >= 8 (a fit keeps a fifth for "
                             f"development), got {self.min_samples}")

    def lines_for(self, label: LabelSpec | None) -> int:
        """K for a question learning `label`: `lines`, or as many as the label looks back (its `reach`:
        `close > ema(close, 50)` rests on 50 bars that 16 lines cannot show), up to `max_lines`."""
        reach = 0 if label is None else label.reach + 1  # the judged bar's own line, and those before it
        return min(max(self.lines, reach), self.max_lines)

    def layer_for(self, num_layers: int, adapter_layer: int | None) -> int:
        if adapter_layer is not None:
            return adapter_layer
        if self.layer is not None:
            if not 0 <= self.layer <= num_layers:
                raise ValueError(f"EngineConfig.learning.layer {self.layer} is outside 0..{num_layers}")
            return self.layer
        return max(1, num_layers * 2 // 5)


@dataclass(frozen=True, slots=True)
class TrainingSet:
    """A copy of a learner's samples, what the worker fits on (oldest first)."""

    lines: torch.Tensor  # [M, F] every line some sample reads
    index: torch.Tensor  # [N, K] rows of `lines` each sample reads, oldest first, left-filled
    reads: torch.Tensor  # [N] lines each sample has (K, or fewer at a session's start)
    labels: torch.Tensor  # [N] choice index
    newest_version: int  # the newest version among the samples
    numbers: torch.Tensor | None = None  # [M, NUMBER_WIDTH] the same lines' own numbers (the control's features)


@dataclass(frozen=True, slots=True)
class Control:
    """The control head: the same series head fitted on the lines' own numbers."""

    proj: torch.Tensor
    proj_bias: torch.Tensor
    lags: torch.Tensor
    bias: torch.Tensor

    def choose(self, numbers: torch.Tensor) -> int:
        """Its answer (a choice index) on the numbers of the newest lines [n, NUMBER_WIDTH]."""
        k = self.lags.shape[1]
        return int(series_logits(numbers[-k:], self.proj, self.proj_bias, self.lags, self.bias).argmax())


HEAD_TENSORS = ("proj", "proj_bias", "lags", "bias")  # a series head's weights (and its control's), in order


def _saved_head(head: SeriesHead | Control, prefix: str = "") -> dict[str, torch.Tensor]:
    """What a snapshot carries of a head's weights: prefix + name -> fp32 on the CPU."""
    return {prefix + name: getattr(head, name).to("cpu", torch.float32).contiguous() for name in HEAD_TENSORS}


def _read_head(tensors: dict[str, torch.Tensor], prefix: str = "") -> tuple[torch.Tensor, ...]:
    """`_saved_head`'s weights back (KeyError when one is missing), in the order heads take them."""
    return tuple(tensors[prefix + name].float() for name in HEAD_TENSORS)


class Learner:
    """One learning question's samples and the head it has learned so far."""

    def __init__(self, config: LearnConfig, choices: tuple[str, ...], lines: int | None = None) -> None:
        self.config = config
        self.lines = config.lines if lines is None else lines  # K: lines each sample (and the head) reads
        self.choices = tuple(c.casefold() for c in choices)
        self._lines: dict[int, torch.Tensor] = {}  # line number -> features [F] (fp32, CPU)
        self._numbers: dict[int, torch.Tensor] = {}  # line number -> its own numbers [NUMBER_WIDTH] (the control's)
        # answered version -> (upto, reads, trained_upto of the head that answered, the control's answer or -1)
        self._waiting: OrderedDict[int, tuple[int, int, int, int]] = OrderedDict()
        self.control: Control | None = None
        # (the answer given was right, the control's was right) per scored answer the control answered too
        self.compared: deque[tuple[bool, bool]] = deque(maxlen=COMPARED)
        # (version, upto, reads, label, trained_upto of the head that answered): that head never saw this sample
        self.samples: deque[tuple[int, int, int, int, int]] = deque()
        self.since_fit = 0  # samples added since the last fit started
        self.fitting = False
        self.fits = 0  # heads swapped in
        self.trained_upto = 0  # newest version the head in force was trained on (0: no head yet)
        self.last_fit_s = 0.0

    def saw(self, version: int, upto: int, taps: LineTaps) -> None:
        """The answer at `version` was made after the session's first `upto` lines: keep what it read."""
        reads = min(upto, self.lines)
        window = taps.window(upto, reads) if reads else None
        if window is None:
            return  # lines not all held (a restore, a compaction gap): no sample at this version
        for offset, features in enumerate(window):
            self._lines.setdefault(upto - reads + offset, features.detach().to("cpu", torch.float32))
        numbers = taps.numbers_window(upto, reads)
        if numbers is not None:  # None for lines pushed before the question (or before a restore)
            for offset, row in enumerate(numbers):
                self._numbers.setdefault(upto - reads + offset, row)
        control = -1 if self.control is None or numbers is None else self.control.choose(numbers)
        self._waiting[version] = (upto, reads, self.trained_upto, control)
        while len(self._waiting) > MAX_WAITING:
            self._waiting.popitem(last=False)
            self._forget_lines()

    def learn(self, version: int, truth: str, correct: bool) -> bool:
        """`version`'s answer was scored against `truth` (`correct`: the answer given was right): now it may be
        trained on, and the control's answer there is scored too. False without its lines."""
        seen = self._waiting.pop(version, None)
        label = self._label(truth)
        if seen is None or label is None:
            return False
        upto, reads, head_upto, control = seen
        if control >= 0:
            self.compared.append((correct, control == label))
        self.samples.append((version, upto, reads, label, head_upto))
        self.since_fit += 1
        if len(self.samples) > self.config.max_samples:
            self.samples.popleft()
            self._forget_lines()
        return True

    def figures(self) -> dict:
        """What stats and the page show of it: heads fitted, samples kept, the newest version trained on."""
        out = {"fits": self.fits, "samples": len(self.samples), "trained_upto": self.trained_upto,
               "fit_s": round(self.last_fit_s, 3)}
        if self.compared:  # the same answers, given and the control's: what the model's states add
            n = len(self.compared)
            out.update(compared=n, answer_accuracy=round(sum(a for a, _ in self.compared) / n, 4),
                       control_accuracy=round(sum(c for _, c in self.compared) / n, 4))
        return out

    def wants_fit(self) -> bool:
        cfg = self.config
        if self.fitting or len(self.samples) < cfg.min_samples:
            return False
        if self.fits and self.since_fit < cfg.every:
            return False
        return len({s[3] for s in self.samples}) > 1  # one truth only: nothing to tell apart yet

    def training_set(self) -> TrainingSet:
        k = self.lines
        needed = sorted({u - r + i for _, u, r, *_ in self.samples for i in range(r)})
        row = {n: i for i, n in enumerate(needed)}
        lines = torch.stack([self._lines[n] for n in needed])
        index = torch.empty(len(self.samples), k, dtype=torch.long)
        for j, (_, u, r, *_) in enumerate(self.samples):
            r = min(r, k)  # a sample restored from a learner that read more lines: its newest k
            rows = [row[n] for n in range(u - r, u)]
            index[j] = torch.tensor([rows[0]] * (k - r) + rows)
        reads = torch.tensor([min(s[2], k) for s in self.samples])
        labels = torch.tensor([s[3] for s in self.samples])
        zero = torch.zeros(NUMBER_WIDTH)  # a line pushed before the question has no numbers kept: zeros
        numbers = torch.stack([self._numbers.get(n, zero) for n in needed])
        return TrainingSet(lines, index, reads, labels, self.samples[-1][0], numbers)

    def export(self, head: SeriesHead | None) -> tuple[dict, dict[str, torch.Tensor]]:
        """What a snapshot, an eviction or a move carries: the samples, the lines they read and the learned
        head (JSON-able counters and tensors), so a restored question answers and goes on learning as it did."""
        numbers = sorted(self._lines)
        meta = {"samples": [list(x) for x in self.samples], "waiting": [[v, *w] for v, w in self._waiting.items()],
                "fits": self.fits, "trained_upto": self.trained_upto, "fit_s": self.last_fit_s,
                "since_fit": self.since_fit, "head": None, "compared": [[int(a), int(c)] for a, c in self.compared]}
        tensors: dict[str, torch.Tensor] = {"line_numbers": torch.tensor(numbers, dtype=torch.int64)}
        if numbers:
            tensors["lines"] = torch.stack([self._lines[n] for n in numbers])
            nan = torch.full((NUMBER_WIDTH,), math.nan)  # NaN: the line's numbers were not kept
            tensors["numbers"] = torch.stack([self._numbers.get(n, nan) for n in numbers])
        if self.control is not None:
            tensors.update(_saved_head(self.control, "control_"))
        if head is not None:
            meta["head"] = {"layer": head.layer, "words": list(head.words), "threshold": head.threshold,
                            "min_lines": head.min_lines, "numbers": head.numbers}
            tensors.update(_saved_head(head))
        return meta, tensors

    def restore(self, meta: dict, tensors: dict[str, torch.Tensor], *, question_id: str, text: str,
                width: int) -> SeriesHead | None:
        """Read back `export`'s output (ValueError naming what is wrong); returns the learned head, if any."""
        try:
            numbers = tensors["line_numbers"].tolist()
            lines = tensors.get("lines")
            if (lines is None) != (not numbers) or (lines is not None and tuple(lines.shape) != (len(numbers), width)):
                raise ValueError(f"lines shaped {None if lines is None else tuple(lines.shape)}, expected "
                                 f"[{len(numbers)}, {width}]")
            samples = [tuple(int(x) for x in row) for row in meta["samples"]]
            # a waiting answer saved before the control was kept has no control answer: -1
            waiting = [tuple(int(x) for x in row) + (-1,) * (6 - len(row)) for row in meta["waiting"]]
            compared = [(bool(a), bool(c)) for a, c in meta.get("compared", [])]
            kept = tensors.get("numbers")
            if kept is not None and tuple(kept.shape) != (len(numbers), NUMBER_WIDTH):
                raise ValueError(f"numbers shaped {tuple(kept.shape)}, expected [{len(numbers)}, {NUMBER_WIDTH}]")
            control = None
            if "control_proj" in tensors:
                control = Control(*_read_head(tensors, "control_"))
                if control.proj.shape[1] != NUMBER_WIDTH or control.lags.shape[0] != len(self.choices):
                    raise ValueError(f"control head shaped {tuple(control.proj.shape)} / {tuple(control.lags.shape)}")
            held = set(numbers)
            for _, u, r, label, _ in samples:
                if not 0 <= label < len(self.choices) or any(n not in held for n in range(u - r, u)):
                    raise ValueError(f"a sample reads lines {u - r}..{u - 1} or label {label} it does not hold")
            head = None
            if meta["head"] is not None:
                h = meta["head"]
                head = SeriesHead(question_id, text, self.choices, int(h["layer"]), *_read_head(tensors),
                                  float(h["threshold"]),
                                  tuple(h["words"]), int(h["min_lines"]), int(h.get("numbers", 0)))
                if head.proj.shape[1] != width + head.numbers or head.lags.shape[0] != len(self.choices):
                    raise ValueError(f"head shaped {tuple(head.proj.shape)} / {tuple(head.lags.shape)} for "
                                     f"{width} features, {head.numbers} numbers and {len(self.choices)} choices")
            fits, trained_upto, fit_s = int(meta["fits"]), int(meta["trained_upto"]), float(meta["fit_s"])
            since_fit = int(meta["since_fit"])
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ValueError(f"learned state of {question_id!r}: {exc}") from None
        self._lines = {n: f for n, f in zip(numbers, lines, strict=True)} if lines is not None else {}
        self._numbers = ({} if kept is None else
                         {n: row for n, row in zip(numbers, kept, strict=True) if not torch.isnan(row).any()})
        self.samples = deque(samples)
        self._waiting = OrderedDict((v, (u, r, hu, c)) for v, u, r, hu, c in waiting)
        self.control, self.compared = control, deque(compared, maxlen=COMPARED)
        self.fits, self.trained_upto, self.last_fit_s, self.since_fit = fits, trained_upto, fit_s, since_fit
        return head

    def _label(self, truth: str) -> int | None:
        try:
            return self.choices.index(truth.casefold())
        except ValueError:
            return None

    def _forget_lines(self) -> None:
        """Drop lines no kept sample and no waiting answer reads."""
        spans = [(u - r, u) for _, u, r, *_ in self.samples] + [(u - r, u) for u, r, *_ in self._waiting.values()]
        if not spans:
            self._lines.clear()
            self._numbers.clear()
            return
        low = min(a for a, _ in spans)
        for n in [n for n in self._lines if n < low]:
            del self._lines[n]
        for n in [n for n in self._numbers if n < low]:
            del self._numbers[n]


def head_window(taps: LineTaps, head: SeriesHead, upto: int) -> torch.Tensor | None:
    """What `head` reads after the session's first `upto` lines: the lines' features [n, F], and with a
    head that reads numbers their own numbers beside them (zeros for a line whose numbers were not kept,
    as in its training set); None until the lines are all held."""
    n = head.reads(upto)
    window = taps.window(upto, n)
    if window is None or not head.numbers:
        return window
    numbers = taps.numbers_window(upto, n, fill=True)
    return torch.cat([window.float(), numbers.to(window.device)], 1)  # fp32: prices lose digits in bf16


def fit_training_set(data: TrainingSet, config: LearnConfig, classes: int, *,
                     clock: Callable[[], float] = time.perf_counter) -> SeriesFit:
    """The live fit: `config`'s series head on `data` (reading the K lines its index gives each sample), its
    newest fifth the development range that picks the step (also what `bench learn`'s raw-number control
    fits, on other line features). `config.budget_s` counts seconds of `clock`."""
    n = len(data.labels)
    split = max(1, n // 5)
    whole = Samples(data.lines, data.index, data.labels, data.reads, torch.zeros(n, dtype=torch.long))
    k = data.index.shape[1]
    return fit_series(whole.subset(torch.arange(n - split)), whole.subset(torch.arange(n - split, n)), classes,
                      k=k, rank=config.rank, grid=(1e-2,), steps=config.steps, budget_s=config.budget_s,
                      lag_basis=lag_basis(k, min(k, config.lines)), clock=clock)


def fit_head(data: TrainingSet, config: LearnConfig, *, question_id: str, text: str, choices: tuple[str, ...],
             layer: int, words: tuple[Word, ...], threshold: float) -> tuple[SeriesHead, Control | None, float]:
    """The fit process's job: a series head fitted on `data` (`fit_training_set`), its control on the same
    samples' numbers (a few features: a small share of the fit), and the wall time of both. The budget
    counts the fit's own CPU time: the fit process runs torch on its one thread, and only when the engine
    leaves a CPU free, so the wall time it waits says nothing about how far it got."""
    t0 = time.perf_counter()
    fit = fit_training_set(data, config, len(choices), clock=time.thread_time)
    head = SeriesHead(question_id, text, choices, layer, fit.proj, fit.proj_bias, fit.lags, fit.bias,
                      threshold, words, min_lines=1)
    control = None
    if data.numbers is not None:
        raw = fit_training_set(TrainingSet(data.numbers, data.index, data.reads, data.labels, data.newest_version),
                               config, len(choices), clock=time.thread_time)
        control = Control(raw.proj, raw.proj_bias, raw.lags, raw.bias)
        if config.numbers:
            head = stacked(head, control, data)
    return head, control, time.perf_counter() - t0


def stacked(states: SeriesHead, control: Control, data: TrainingSet) -> SeriesHead:
    """One head answering a * (the states head's logits) + b * (the control's) + c, with a, b and the
    per-choice c fitted on the newest fifth of `data` (the development range neither head trained on,
    only their early stops read it; a weighing of two heads is all it decides). The weights start at the
    control alone (a = 0, b = 1) and are pulled back there in proportion to how few samples decide them,
    and kept in [0, 3]: a small or separable development range cannot blow them up. Where the states add
    nothing a stays ~0 and it answers as the control; where they do, they weigh in.

    It is an ordinary series head over [states, numbers] per line: the two projections side by side
    (block-diagonal), their lags placed by rows, each scaled by its weight."""
    n = len(data.labels)
    dev = torch.arange(n - max(1, n // 5), n)
    numbers_head = SeriesHead(states.question_id, states.text, states.choices, states.layer, control.proj,
                              control.proj_bias, control.lags, control.bias, states.threshold)
    # each head's logits as served (SeriesHead.logits on the lines each sample has)
    s_logits, n_logits = (Samples(lines, data.index, data.labels, data.reads, torch.zeros(n, dtype=torch.long))
                          .subset(dev).logits(head) for lines, head in ((data.lines, states),
                                                                        (data.numbers, numbers_head)))
    prior = torch.tensor([0.0, 1.0])
    weights = prior.clone().requires_grad_(True)
    offset = torch.zeros(s_logits.shape[1], requires_grad=True)
    opt = torch.optim.LBFGS([weights, offset], lr=0.5, max_iter=60, line_search_fn="strong_wolfe")
    labels = data.labels[dev]
    pull = 4.0 / len(dev)  # as much as four samples' worth of evidence

    def loss() -> torch.Tensor:
        opt.zero_grad()
        value = torch.nn.functional.cross_entropy(weights[0] * s_logits + weights[1] * n_logits + offset, labels)
        value = value + pull * (((weights - prior) ** 2).sum() + (offset ** 2).sum())
        value.backward()
        return value

    with torch.enable_grad():
        opt.step(loss)
    a, b = (float(w) for w in weights.detach().clamp(0.0, 3.0))
    rs, rn = states.proj.shape[0], control.proj.shape[0]
    f, w = states.proj.shape[1], control.proj.shape[1]
    proj = torch.zeros(rs + rn, f + w)
    proj[:rs, :f], proj[rs:, f:] = states.proj.float(), control.proj.float()
    ls, ln = states.lags.float(), control.lags.float()
    lags = torch.cat([a * ls[..., :rs], b * ln[..., :rn], a * ls[..., rs:], b * ln[..., rn:]], -1)
    bias = a * states.bias.float() + b * control.bias.float() + offset.detach()
    return SeriesHead(states.question_id, states.text, states.choices, states.layer, proj,
                      torch.cat([states.proj_bias.float(), control.proj_bias.float()]), lags, bias,
                      states.threshold, states.words, states.min_lines, w)


class Learning:
    """The core's learning component: starts fits in the fit process, swaps finished heads in."""

    def __init__(self, config: LearnConfig, *, layer: int, words: tuple[Word, ...],
                 device: torch.device | str = "cpu") -> None:
        self.config = config
        self.layer, self.words, self.device = layer, words, device
        # id(standing) -> (it, its fit, the newest version the fit trains on); a question dropped meanwhile
        # leaves (`drop`), so whatever is here when its fit finishes is still registered
        self._running: dict[int, tuple[Standing, Future, int]] = {}
        self.wake: Callable[[], object] = lambda: None  # the core's: a finished fit asks it to swap the head in
        self.fits_done = 0
        self.fits_failed = 0

    @property
    def busy(self) -> bool:
        """Whether a fit is running or waiting to be swapped in (benches replaying faster than live wait)."""
        return bool(self._running)

    def wants(self, st: Standing) -> bool:
        """Whether a newly registered question learns: labelled, with choices, and no head of its own (or
        `learn = true`: beside an adapter's head too, which the first fit replaces; `learn = false`: never)."""
        spec = st.spec
        if not (spec.choices and spec.label is not None) or spec.learn is False:
            return False
        return st.gate.head is None or spec.learn is True

    def scored(self, st: Standing, version: int, truth: str, correct: bool) -> None:
        """An answer of `st` was scored (`correct`: it was right): its sample may be trained on now; maybe
        start a fit."""
        learner = st.learner
        if learner is None or not learner.learn(version, truth, correct) or not learner.wants_fit():
            return
        learner.fitting, learner.since_fit = True, 0
        data = learner.training_set()
        spec = st.spec
        future = submit_fit(fit_head, data, self.config, question_id=spec.id, text=spec.text,
                                     choices=tuple(spec.choices), layer=self.layer, words=self.words,
                                     threshold=float(spec.threshold))
        self._running[id(st)] = (st, future, data.newest_version)
        future.add_done_callback(lambda _: self.wake())

    def swap_finished(self) -> list[Standing]:
        """Between steps: put each finished head in its question's gate."""
        swapped = []
        for key, (st, future, newest_version) in list(self._running.items()):
            if not future.done():
                continue
            del self._running[key]
            st.learner.fitting = False
            try:
                head, control, seconds = future.result()
            except Exception:  # a fit that fails keeps the head in force; the next samples try again
                log.exception("live fit of %s failed", st.spec.id)
                self.fits_failed += 1
                continue
            st.gate.head = head.to(self.device, torch.float32)  # heads read fp32 features
            st.learner.control = control
            st.learner.fits += 1
            st.learner.trained_upto = newest_version
            st.learner.last_fit_s = seconds
            self.fits_done += 1
            swapped.append(st)
        return swapped

    def drop(self, st: Standing) -> None:
        self._running.pop(id(st), None)

    def shutdown(self) -> None:
        """This engine's fits are forgotten: the fit process finishes those it holds, and nobody reads them."""
        self._running.clear()
