"""The label language: yes/no (or bucket) expressions over bar columns, `close > sma(close, 20)`.

Text is parsed with `ast.parse(mode="eval")` and compiled to a tree of `Node`s by walking an
allow-list of node types; nothing is ever eval'd or compiled to code. Window and offset arguments
are integer literals, so how many bars a label reads (`past`, `future`) is fixed at parse time.

Evaluation is vectorised over a range of rows (numpy, float64): `evaluate_rows(node, columns, lo,
hi)`. Unknown is NaN all the way through: a missing column, a row before the first bar or after the
last, a division by zero; comparisons and `and`/`or`/`not` keep it unknown (three-valued logic: `x
and False` is False, `x and True` unknown). Booleans are 1.0 / 0.0, a bucket its index.

Window sums add their terms oldest first exactly as Python's `sum()` does (left to right; from 3.12
with Neumaier's compensation), so `sum(closes) / n` in plain Python and `mean(close, n)` here agree
to the last bit: a single row sums with `sum()` itself, many rows replay the same additions on
numpy arrays (`_sequential_sum`; tests compare the two on 45k bars).
"""

from __future__ import annotations

import ast
import difflib
import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

# Columns a label may read. `vwap` falls back to the typical price (h + l + c) / 3 on a bar without
# one; `trades` and `buy_share` (buy volume / volume) are unknown where the bars do not carry them.
BASE_COLUMNS = ("open", "high", "low", "close", "volume", "vwap", "trades", "buy_share")
DERIVED_COLUMNS = {"range": 0, "change": 1}  # high - low; close - close[-1] (bars before the current)
COLUMNS = (*BASE_COLUMNS, *DERIVED_COLUMNS)
VOLUME_COLUMNS = frozenset({"volume", "buy_share"})  # unknown on bar tables without volume

MAX_WINDOW = 5000  # bars one label may read, past and future together
_SMALL_RANGE = 8  # rows up to which windows are summed row by row with Python's own sum()

WINDOWS = ("sma", "mean", "sum", "min", "max", "std", "ema")  # f(x, n) over the last n bars (+n: next n)
WINDOW_OPS = frozenset({"mean", "sum", "min", "max", "std", "ema"})  # sma compiles to mean
MAX_BUCKET_EDGES = 15  # a question has at most 16 choices (config.specs.MAX_CHOICES)
FUNCTIONS = (*WINDOWS, "abs", "sqrt", "ret", "bucket")
_COMPARE = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}
_ARITH = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
_OTHER_OPERATORS = {ast.Pow: "**", ast.Mod: "%", ast.FloorDiv: "//", ast.MatMult: "@", ast.BitAnd: "&",
                    ast.BitOr: "|", ast.BitXor: "^", ast.LShift: "<<", ast.RShift: ">>", ast.Invert: "~"}


class LabelError(ValueError):
    """A label text that does not parse, or names an unknown label, column, function or parameter."""


@dataclass(frozen=True, slots=True)
class Node:
    """One step of a compiled label. `kind`: "num", "bool" or "choice" (a bucket's index).

    `past`/`future`: bars before/after a row that its value reads (a window of n reads n - 1 before)."""

    op: str  # "col", "num", an operator ("+", "<", "and", ...), "shift", "ret", a function name, "bucket"
    kind: str
    args: tuple[Node, ...] = ()
    value: str | float | int | tuple[float, ...] | None = None  # column, literal, window/offset, edges
    past: int = 0
    future: int = 0
    reads: frozenset[str] = frozenset()


# -- parsing -----------------------------------------------------------------------------


def did_you_mean(word: str, options: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def located(text: str, message: str, offset: int) -> LabelError:
    """An error pointing at `offset` (0-based) of the label text: `at column N`, the text, a caret."""
    shown = text.replace("\n", " ")
    return LabelError(f"{message} at column {offset + 1}\n  {shown}\n  {' ' * offset}^")


@dataclass(slots=True)
class _Compiler:
    text: str  # the text parsed (stripped): columns count from its start
    line_starts: tuple[int, ...]
    named: tuple[str, ...]  # the named labels (for did-you-mean; they are no part of an expression)

    @classmethod
    def of(cls, text: str, named: tuple[str, ...]) -> _Compiler:
        starts, at = [0], 0
        for line in text.split("\n")[:-1]:
            at += len(line) + 1
            starts.append(at)
        return cls(text, tuple(starts), named)

    def fail(self, node: ast.AST, message: str) -> LabelError:
        line = getattr(node, "lineno", 1)
        return located(self.text, message, self.line_starts[line - 1] + getattr(node, "col_offset", 0))

    def root(self, node: ast.AST) -> Node:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "bucket":
            return self.bucket(node)
        out = self.expr(node)
        if out.kind != "bool":
            raise self.fail(node, f"a label is yes/no (a comparison, `and`, `or`, `not`) or a bucket(...); "
                                  f"{ast.unparse(node)!r} is a number")
        return out

    def expr(self, node: ast.AST) -> Node:
        if isinstance(node, ast.Constant):
            value = node.value
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise self.fail(node, f"{value!r} is not a number; a label reads numbers, columns and functions")
            return Node("num", "num", value=float(value))
        if isinstance(node, ast.Name):
            return self.column(node)
        if isinstance(node, ast.UnaryOp):
            if isinstance(node.op, ast.Not):
                return self.logic("not", node, [node.operand])
            if isinstance(node.op, ast.USub | ast.UAdd):
                operand = self.number(node.operand, "unary minus")
                if isinstance(node.op, ast.UAdd):
                    return operand
                if operand.op == "num":
                    return Node("num", "num", value=-operand.value)
                return _derive("neg", "num", (operand,))
            raise self.fail(node, f"operator {_OTHER_OPERATORS.get(type(node.op), '?')!r} is not part of the "
                                  "label language (+ - * / only)")
        if isinstance(node, ast.BinOp):
            op = _ARITH.get(type(node.op))
            if op is None:
                raise self.fail(self.operator(node), f"operator {_OTHER_OPERATORS.get(type(node.op), '?')!r} is not part of the "
                                      "label language (+ - * / only)")
            return _derive(op, "num", (self.number(node.left, op), self.number(node.right, op)))
        if isinstance(node, ast.BoolOp):
            return self.logic("and" if isinstance(node.op, ast.And) else "or", node, node.values)
        if isinstance(node, ast.Compare):
            return self.compare(node)
        if isinstance(node, ast.Call):
            return self.call(node)
        if isinstance(node, ast.Subscript):
            return self.offset(node)
        what = {ast.Attribute: "'.'", ast.List: "a list (only bucket edges are one)", ast.Lambda: "lambda",
                ast.IfExp: "'if'", ast.Starred: "'*'"}.get(type(node), type(node).__name__)
        raise self.fail(node, f"label {self.text!r} does not parse: {what} is not part of the label language")

    def operator(self, node: ast.BinOp) -> ast.AST:
        """Where the operator of `node` is written (ast keeps only its operands' places)."""
        start, end = node.left.end_col_offset or 0, node.right.col_offset
        if node.left.end_lineno == node.lineno == node.right.lineno:
            line = self.text[self.line_starts[node.lineno - 1]:].split("\n", 1)[0]
            symbol = _OTHER_OPERATORS.get(type(node.op), "")
            found = line.find(symbol, start, end) if symbol else -1
            if found >= 0:
                return ast.Name(id="", lineno=node.lineno, col_offset=found)
        return node

    def column(self, node: ast.Name) -> Node:
        name = node.id
        if name in DERIVED_COLUMNS:
            return Node("col", "num", value=name, past=DERIVED_COLUMNS[name],
                        reads=frozenset({"high", "low"} if name == "range" else {"close"}))
        if name in BASE_COLUMNS:
            return Node("col", "num", value=name, reads=frozenset({name}))
        if name in FUNCTIONS:
            raise self.fail(node, f"{name!r} is a function: call it, like {name}(...)")
        hint = did_you_mean(name, COLUMNS) or did_you_mean(name, self.named) or f" (columns: {', '.join(COLUMNS)})"
        raise self.fail(node, f"unknown column {name!r}{hint}")

    def number(self, node: ast.AST, where: str) -> Node:
        out = self.expr(node)
        if out.kind != "num":
            raise self.fail(node, f"{where} needs a number; {ast.unparse(node)!r} is yes/no")
        return out

    def boolean(self, node: ast.AST, where: str) -> Node:
        out = self.expr(node)
        if out.kind != "bool":
            raise self.fail(node, f"{where!r} needs a yes/no (a comparison); {ast.unparse(node)!r} is a number")
        return out

    def logic(self, op: str, node: ast.AST, operands: Sequence[ast.AST]) -> Node:
        args = [self.boolean(a, op) for a in operands]
        if op == "not":
            return _derive("not", "bool", (args[0],))
        out = args[0]
        for arg in args[1:]:
            out = _derive(op, "bool", (out, arg))
        return out

    def compare(self, node: ast.Compare) -> Node:
        # `a < b < c` reads `a < b and b < c`, as in Python.
        operands = [node.left, *node.comparators]
        values = []
        for operand in operands:
            out = self.expr(operand)
            if out.kind != "num":
                raise self.fail(operand, f"comparison of a yes/no with a number: {ast.unparse(operand)!r} is yes/no")
            values.append(out)
        parts = []
        for op, left, right in zip(node.ops, values, values[1:], strict=False):
            symbol = _COMPARE.get(type(op))
            if symbol is None:
                raise self.fail(node, f"{type(op).__name__} is not part of the label language "
                                      "(< <= > >= == != only)")
            parts.append(_derive(symbol, "bool", (left, right)))
        out = parts[0]
        for part in parts[1:]:
            out = _derive("and", "bool", (out, part))
        return out

    def call(self, node: ast.Call) -> Node:
        if not isinstance(node.func, ast.Name):
            raise self.fail(node, f"label {self.text!r} does not parse: only named functions can be called")
        name = node.func.id
        if name not in FUNCTIONS:
            if name in self.named:
                raise self.fail(node, f"named label {name!r} cannot be part of an expression; write what it "
                                      "means (docs/questions.md lists each one's expression)")
            hint = did_you_mean(name, (*FUNCTIONS, *self.named)) or f" (functions: {', '.join(FUNCTIONS)})"
            raise self.fail(node, f"unknown function {name!r}{hint}")
        if node.keywords:
            raise self.fail(node.keywords[0].value, f"{name}() takes no named arguments")
        if name == "bucket":
            raise self.fail(node, "bucket(...) is a whole label, not part of one")
        if name in ("abs", "sqrt"):
            self.arity(node, 1, f"{name}(x)")
            return _derive(name, "num", (self.number(node.args[0], name),))
        if name == "ret":
            self.arity(node, 1, "ret(n)")
            n, ahead = self.window(node.args[0], "ret")
            return Node("ret", "num", value=n if ahead else -n, past=0 if ahead else n, future=n if ahead else 0,
                        reads=frozenset({"close"}))
        self.arity(node, 2, f"{name}(x, n)")
        x = self.number(node.args[0], name)
        n, ahead = self.window(node.args[1], name)
        if name == "ema" and ahead:
            raise self.fail(node.args[1], "ema(x, n) looks back only: write n, not +n")
        if name == "std" and n < 2:
            raise self.fail(node.args[1], "std(x, n) needs a window of at least 2 bars")
        op = "mean" if name == "sma" else name
        if ahead:  # bars t+1 .. t+n
            out = Node(op, "num", (x,), n, max(x.past - 1, 0), x.future + n, x.reads)
        else:
            span = 4 * n if name == "ema" else n
            out = Node(op, "num", (x,), -n, x.past + span - 1, x.future, x.reads)
        return self.bounded(node, out)

    def bucket(self, node: ast.Call) -> Node:
        self.arity(node, 2, "bucket(x, [e1, e2, ...])")
        if node.keywords:
            raise self.fail(node.keywords[0].value, "bucket() takes no named arguments")
        x = self.number(node.args[0], "bucket")
        edges_node = node.args[1]
        if not isinstance(edges_node, ast.List) or not edges_node.elts:
            raise self.fail(edges_node, "bucket edges must be a list of numbers, like [-0.001, 0.001]")
        if len(edges_node.elts) > MAX_BUCKET_EDGES:
            raise self.fail(edges_node, f"bucket takes at most {MAX_BUCKET_EDGES} edges ({MAX_BUCKET_EDGES + 1} "
                                        f"choices), got {len(edges_node.elts)}")
        edges = []
        for elt in edges_node.elts:
            try:
                value = ast.literal_eval(elt)
            except ValueError:
                value = None
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise self.fail(elt, f"bucket edge {ast.unparse(elt)!r} is not a number literal")
            if edges and value <= edges[-1]:
                raise self.fail(elt, f"bucket edges must increase strictly: {value!r} after {edges[-1]!r}")
            edges.append(value)
        return Node("bucket", "choice", (x,), tuple(map(float, edges)), x.past, x.future, x.reads)

    def arity(self, node: ast.Call, count: int, usage: str) -> None:
        if len(node.args) != count:
            raise self.fail(node, f"{usage} takes {count} argument{'s' if count > 1 else ''}, got {len(node.args)}")

    def window(self, node: ast.AST, name: str) -> tuple[int, bool]:
        """A window argument: `n` (the last n bars, the current one included) or `+n` (the next n)."""
        ahead = isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd)
        behind = isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)
        literal = node.operand if ahead or behind else node
        value = literal.value if isinstance(literal, ast.Constant) else None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(node, f"{name}(): the window must be an integer literal (bars), got {ast.unparse(node)!r}")
        if behind:
            raise self.fail(node, f"{name}(): a window counts bars, write {value} for the last {value} "
                                  f"or +{value} for the next {value}")
        if value == 0:
            raise self.fail(node, f"{name}(): a window of 0 bars reads nothing")
        if value > MAX_WINDOW:
            raise self.fail(node, f"{name}(): a window of {value} bars is over the limit of {MAX_WINDOW}")
        return value, ahead

    def offset(self, node: ast.Subscript) -> Node:
        x = self.number(node.value, "an offset [..]")
        index = node.slice
        sign = -1 if isinstance(index, ast.UnaryOp) and isinstance(index.op, ast.USub) else (
            1 if isinstance(index, ast.UnaryOp) and isinstance(index.op, ast.UAdd) else 0)
        literal = index.operand if sign else index
        value = literal.value if isinstance(literal, ast.Constant) else None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(index, f"an offset must be an integer literal like [-10] or [+5], got "
                                   f"{ast.unparse(index)!r}")
        if not sign or value == 0:
            raise self.fail(index, f"write [-{value or 1}] for bars ago or [+{value or 1}] for bars ahead"
                                   + (" (an offset of 0 is the bar itself)" if value == 0 else ""))
        if value > MAX_WINDOW:
            raise self.fail(index, f"an offset of {value} bars is over the limit of {MAX_WINDOW}")
        k = sign * value  # negative: bars ago
        out = Node("shift", "num", (x,), k, max(x.past - k, 0), max(x.future + k, 0), x.reads)
        return self.bounded(node, out)

    def bounded(self, node: ast.AST, out: Node) -> Node:
        if out.past + 1 + out.future > MAX_WINDOW:
            raise self.fail(node, f"this reads {out.past + 1 + out.future} bars, over the limit of {MAX_WINDOW}")
        return out


def _derive(op: str, kind: str, args: tuple[Node, ...]) -> Node:
    return Node(op, kind, args, None, max(a.past for a in args), max(a.future for a in args),
                frozenset().union(*(a.reads for a in args)))


def reach(node: Node) -> int:
    """Bars before a row that its value mostly rests on: `past`, except that an ema counts the 2n bars
    that hold 98% of its weights ((1 - 2/(n+1))^2n ~ e^-4; its n bars alone hold 87%, and a head that
    reads only those is wrong near every crossing), not the 4n it reads to warm up. What a learned head
    reads (its lines)."""
    if node.op == "shift":
        return max(reach(node.args[0]) - int(node.value), 0)
    if node.op == "col":
        return node.past
    if node.op == "ret":
        return node.past
    inner = max((reach(a) for a in node.args), default=0)
    if node.op in WINDOW_OPS and isinstance(node.value, int) and node.value < 0:  # a window back over n bars
        return inner + (-node.value) * (2 if node.op == "ema" else 1) - 1
    return inner


# CPython 3.11 keeps the AST constructor's recursion depth in interpreter-wide state: a parse that
# another thread's parse interleaves with (through a collection running finalizers) can fail with
# "SystemError: AST constructor recursion depth mismatch" (python/cpython#106905). Sessions restored
# from disk on several threads parse their labels at once: ours parse one at a time, and a parse
# that still meets it (some other code parsing meanwhile) is tried again; the parse is pure.
_PARSING = threading.Lock()
_parse = ast.parse  # (a name of this module's, for the test that stands in for the race)


def parse_eval(text: str) -> ast.expr:
    """`ast.parse(text, mode="eval").body`, one thread at a time (SyntaxError as ast.parse raises it)."""
    with _PARSING:
        try:
            return _parse(text, mode="eval").body
        except SystemError as exc:
            if "recursion depth mismatch" not in str(exc):
                raise
            return _parse(text, mode="eval").body


def compile_expression(text: str, tree: ast.AST | None = None, named: Sequence[str] = ()) -> Node:
    """Compile a label expression (already size-checked; `tree`: its parse when at hand); raises
    LabelError pointing at the bad token. `named`: the named labels, refused inside an expression."""
    compiler = _Compiler.of(text, tuple(named))
    if tree is None:
        try:
            tree = parse_eval(text)
        except SyntaxError as exc:
            if exc.offset:
                offset = compiler.line_starts[(exc.lineno or 1) - 1] + exc.offset - 1
            else:  # the text ended too early
                offset = len(text)
            raise located(text, f"label {text!r} does not parse ({exc.msg})", min(offset, len(text))) from None
    return compiler.root(tree)


# -- evaluation --------------------------------------------------------------------------


# Python's sum() of floats: plain left-to-right additions up to 3.11, Neumaier-compensated from 3.12.
_COMPENSATED_SUM = sum([1e100, 1.0, -1e100]) == 1.0


def _sequential_sum(terms: Iterable[np.ndarray]) -> np.ndarray:
    """Elementwise sum of `terms` (oldest first) by the very additions Python's sum() makes."""
    terms = iter(terms)
    with np.errstate(invalid="ignore", over="ignore"):
        total = next(terms).astype(np.float64, copy=True)
        if not _COMPENSATED_SUM:
            for term in terms:
                total += term
            return total
        compensation = np.zeros_like(total)
        for term in terms:
            t = total + term
            big = np.abs(total) >= np.abs(term)
            compensation += np.where(big, (total - t) + term, (term - t) + total)
            total = t
        fix = (compensation != 0) & np.isfinite(compensation)
        return np.where(fix, total + compensation, total)


def _window_sums(values: np.ndarray, n: int, rows: int) -> np.ndarray:
    """Sums of `rows` windows of n consecutive values (window i: values[i : i + n])."""
    if rows <= _SMALL_RANGE:
        flat = values.tolist()
        return np.array([sum(flat[i:i + n]) for i in range(rows)], dtype=np.float64)
    return _sequential_sum(values[k:k + rows] for k in range(n))


def _ema(values: np.ndarray, n: int, rows: int) -> np.ndarray:
    # Seeded at the mean of the oldest n of 4n values, then 3n steps of e = a*x + (1-a)*e.
    alpha = 2.0 / (n + 1)
    keep = 1.0 - alpha
    seed = _window_sums(values[: rows + n - 1], n, rows) / n
    if rows <= _SMALL_RANGE:
        flat = values.tolist()
        out = []
        for i, e in enumerate(seed.tolist()):
            for x in flat[i + n: i + 4 * n]:
                e = alpha * x + keep * e
            out.append(e)
        return np.array(out, dtype=np.float64)
    e = seed
    for k in range(n, 4 * n):
        e = alpha * values[k:k + rows] + keep * e
    return e


def _unknown_where(result: np.ndarray, *inputs: np.ndarray) -> np.ndarray:
    unknown = np.zeros(result.shape, dtype=bool)
    for x in inputs:
        unknown |= np.isnan(x)
    return np.where(unknown, np.nan, result)


_COMPARATORS: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "<": np.less, "<=": np.less_equal, ">": np.greater, ">=": np.greater_equal, "==": np.equal,
    "!=": np.not_equal,
}


def evaluate_rows(node: Node, columns: Mapping[str, np.ndarray], lo: int, hi: int) -> np.ndarray:
    """The node's values at rows lo..hi (inclusive) of `columns` (equal-length float arrays, every
    column of COLUMNS; NaN: unknown). Rows outside the columns read as unknown."""
    return _Rows(columns).value(node, lo, hi - lo + 1)


@dataclass(slots=True)
class _Rows:
    """Evaluates a node on `rows` consecutive rows from `first`; a child is asked for the rows its
    parent reads (a window of n: n - 1 more before; an offset: the same count, shifted)."""

    columns: Mapping[str, np.ndarray]

    def column(self, name: str, first: int, rows: int) -> np.ndarray:
        data = self.columns[name]
        out = np.full(rows, np.nan)
        a, b = max(first, 0), min(first + rows, len(data))
        if a < b:
            out[a - first: b - first] = data[a:b]
        return out

    def value(self, node: Node, first: int, rows: int) -> np.ndarray:
        op = node.op
        if op == "num":
            return np.full(rows, node.value, dtype=np.float64)
        if op == "col":
            return self.column(node.value, first, rows)
        if op == "shift":
            return self.value(node.args[0], first + node.value, rows)
        if op == "ret":
            k = node.value
            now, other = self.column("close", first, rows), self.column("close", first + k, rows)
            before, after = (other, now) if k < 0 else (now, other)
            with np.errstate(divide="ignore", invalid="ignore"):
                out = after / before - 1.0
            return np.where((before == 0) | (after == 0), np.nan, out)
        if op in WINDOW_OPS:
            return self.window(node, first, rows)
        args = [self.value(a, first, rows) for a in node.args]
        if op in _COMPARATORS:
            return _unknown_where(_COMPARATORS[op](args[0], args[1]).astype(np.float64), *args)
        if op == "not":
            return 1.0 - args[0]
        if op == "and":
            a, b = args
            return np.where((a == 0) | (b == 0), 0.0, np.where(np.isnan(a) | np.isnan(b), np.nan, 1.0))
        if op == "or":
            a, b = args
            return np.where((a == 1) | (b == 1), 1.0, np.where(np.isnan(a) | np.isnan(b), np.nan, 0.0))
        if op == "bucket":
            x = args[0]
            index = np.searchsorted(np.asarray(node.value), x, side="right").astype(np.float64)
            return np.where(np.isnan(x), np.nan, index)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            if op == "neg":
                return -args[0]
            if op == "abs":
                return np.abs(args[0])
            if op == "sqrt":
                return np.where(args[0] < 0, np.nan, np.sqrt(np.maximum(args[0], 0.0)))
            if op == "+":
                return args[0] + args[1]
            if op == "-":
                return args[0] - args[1]
            if op == "*":
                return args[0] * args[1]
            if op == "/":
                return np.where(args[1] == 0, np.nan, args[0] / args[1])
        raise AssertionError(f"unknown op {op!r}")  # the compiler makes only the ops above

    def window(self, node: Node, first: int, rows: int) -> np.ndarray:
        op, k = node.op, node.value  # k = -n: the last n bars, the current one included; +n: the next n
        n = abs(k)
        span = 4 * n if op == "ema" else n
        start = first - span + 1 if k < 0 else first + 1
        x = self.value(node.args[0], start, rows + span - 1)  # row i's window: x[i : i + span]
        if op == "ema":
            return _ema(x, n, rows)
        if op in ("min", "max"):
            reduce = np.minimum if op == "min" else np.maximum  # NaN in the window: NaN
            out = x[:rows].copy()
            for j in range(1, n):
                out = reduce(out, x[j:j + rows])
            return out
        total = _window_sums(x, n, rows)
        if op == "sum":
            return total
        mean = total / n
        if op == "mean":
            return mean
        # std: the sample standard deviation (n - 1), two passes: the mean, then squared deviations
        squares = _sequential_sum((x[j:j + rows] - mean) ** 2 for j in range(n))
        return np.sqrt(squares / (n - 1))
