"""Which number format the forward runs in: `auto`, `float32` or `bfloat16`, decided by what runs.

`auto` picks bf16 on CUDA devices that support it, and on CPUs whose bf16 matrix
products really run on a bf16 kernel (AMX or AVX512-BF16): a probe at start-up runs one
product of the default model's shape, reads the kernel oneDNN chose from its verbose log
(e.g. `brg_matmul:avx512_core_bf16`, `brg_matmul:avx512_core_amx`), and times it against
fp32. `lscpu` alone is not enough (a virtual machine may list AMX and not grant its tile
state). The kernel decides; the timing decides only when oneDNN's log could not be read
(timings on a shared machine are too noisy to overrule the kernel it names).

`STREAMLLM_DTYPE=float32|bfloat16` in the environment overrides what `auto` picks (an
operator's say on a machine the probe misjudges; the test suite pins float32 with it).

The model also measures, per weight kind over all its layers' weights, up to how many
rows fp32 products beat bf16 (`fp32_crossover`): steps with that few rows use fp32 copies
of those weights, so a one-row decode step is not slower than in fp32.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

DTYPE_CHOICES = ("auto", "float32", "bfloat16")
ENV_VAR = "STREAMLLM_DTYPE"
_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
# Without a kernel name, auto takes bf16 on a CPU only when it is this much faster than fp32 (64 rows).
MIN_CPU_SPEEDUP = 1.5
# Row counts the crossover probe tries; beyond the last, bf16 products are taken to win.
CROSSOVER_ROWS = (1, 2, 4, 8)


@dataclass(slots=True, frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    requested: str  # what the caller asked for: auto | float32 | bfloat16 ($STREAMLLM_DTYPE's, when it set auto)
    reason: str  # one line for start-up logs and /health

    @property
    def name(self) -> str:
        return dtype_name(self.dtype)


@dataclass(slots=True, frozen=True)
class CpuProbe:
    kernel: str  # oneDNN's implementation for a bf16 matmul, e.g. brg_matmul:avx512_core_bf16 ("" if unseen)
    speedup: float  # fp32 ms / bf16 ms for a 64-row product of the default model's MLP shape
    flags: str  # what the CPU reports (torch.cpu / cpuinfo): amx_bf16, avx512_bf16


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(spec: str | torch.dtype | None) -> str | torch.dtype:
    """'auto', or the torch dtype named by spec; ValueError names the valid choices."""
    if isinstance(spec, torch.dtype):
        if spec not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype {dtype_name(spec)} is not supported; choose one of {', '.join(DTYPE_CHOICES)}")
        return spec
    if spec is None or spec == "auto":
        return "auto"
    dtype = _NAMES.get(str(spec).lower())
    if dtype is None:
        raise ValueError(f"unknown dtype {spec!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    return dtype


def resolve_dtype(spec: str | torch.dtype | None, device: torch.device | str) -> DtypeChoice:
    """The dtype to run on `device`, and why."""
    parsed = parse_dtype(spec)
    device = torch.device(device)
    forced = os.environ.get(ENV_VAR, "auto")
    if parsed == "auto" and forced != "auto":
        try:
            dtype = parse_dtype(forced)
        except ValueError as exc:
            raise ValueError(f"${ENV_VAR}: {exc}") from None
        chosen = resolve_dtype(dtype, device).dtype  # asked for by name, through the environment
        return DtypeChoice(chosen, dtype_name(chosen), f"{forced} (auto, set by ${ENV_VAR})")
    if isinstance(parsed, torch.dtype):
        if parsed == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ValueError(f"dtype bfloat16 requested but {torch.cuda.get_device_name(device)} has no bf16 support")
        return DtypeChoice(parsed, dtype_name(parsed), f"{dtype_name(parsed)} (requested)")
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return DtypeChoice(torch.bfloat16, "auto", f"bfloat16 (auto: {torch.cuda.get_device_name(device)})")
        return DtypeChoice(torch.float32, "auto", "float32 (auto: this GPU has no bf16)")
    if device.type != "cpu":
        return DtypeChoice(torch.float32, "auto", f"float32 (auto: no bf16 rule for device {device.type})")
    probe = cpu_probe()
    if not probe.flags:
        return DtypeChoice(torch.float32, "auto", "float32 (auto: the CPU has neither AMX nor AVX512-BF16)")
    seen = probe.kernel or "a kernel oneDNN did not name"
    if probe.kernel and "bf16" not in probe.kernel and "amx" not in probe.kernel:
        return DtypeChoice(torch.float32, "auto", f"float32 (auto: bf16 products run on {seen}, no bf16 kernel)")
    if not probe.kernel and probe.speedup < MIN_CPU_SPEEDUP:
        return DtypeChoice(torch.float32, "auto", f"float32 (auto: bf16 on {seen} is only {probe.speedup:.1f}x fp32)")
    return DtypeChoice(torch.bfloat16, "auto",
                       f"bfloat16 (auto: {probe.flags}; products run on {seen}, {probe.speedup:.1f}x fp32 at 64 rows)")


def _cpu_flags() -> str:
    found = []
    cpu = getattr(torch, "cpu", None)
    if cpu is not None and getattr(cpu, "_is_amx_tile_supported", lambda: False)():
        # cpuinfo sees the tiles; oneDNN still has to be granted them by the kernel (arch_prctl).
        found.append("amx_bf16")
    if cpu is not None and getattr(cpu, "_is_avx512_bf16_supported", lambda: False)():
        found.append("avx512_bf16")
    return " ".join(found)


@functools.cache
def cpu_probe() -> CpuProbe:
    """Run and time one bf16 product (once per process): which kernel, how fast against fp32."""
    flags = _cpu_flags()
    if not flags:
        return CpuProbe("", 0.0, "")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 576, generator=gen)
    w = torch.randn(3072, 576, generator=gen)
    xb, wb = x.bfloat16(), w.bfloat16()
    with torch.inference_mode():
        kernel = onednn_kernel(lambda: F.linear(xb, wb))
        fp32, bf16 = time_pair(lambda: F.linear(x, w), lambda: F.linear(xb, wb))
    return CpuProbe(kernel, fp32 / bf16, flags)


def time_pair(a: Callable[[], object], b: Callable[[], object], reps: int = 7) -> tuple[float, float]:
    """Best ms of a and b, interleaved so that a noisy neighbour hits both alike."""
    ta, tb = [], []
    for i in range(reps + 1):
        for fn, out in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            fn()
            if i:  # the first round warms up (primitive creation, weight reorders)
                out.append((time.perf_counter() - t0) * 1000)
    return min(ta), min(tb)


def onednn_kernel(fn: Callable[[], object]) -> str:
    """The implementation oneDNN ran for `fn`'s first matmul (its verbose log, read from fd 1)."""
    verbose = getattr(torch.backends.mkldnn, "verbose", None)
    if verbose is None:
        return ""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return ""
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as tmp:
        try:
            os.dup2(tmp.fileno(), 1)
            with verbose(torch.backends.mkldnn.VERBOSE_ON):
                fn()
            libc.fflush(None)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read().decode(errors="replace")
    for line in text.splitlines():
        fields = line.split(",")
        # onednn_verbose,v1,primitive,exec,cpu,matmul,brg_matmul:avx512_core_bf16,...
        if "exec" in fields and len(fields) > 6 and fields[fields.index("exec") + 2] in ("matmul", "inner_product"):
            return fields[fields.index("exec") + 3]
    return ""


def fp32_crossover(weights: dict[str, list[tuple[torch.Tensor, torch.Tensor]]],
                   rows: tuple[int, ...] = CROSSOVER_ROWS) -> dict[str, int]:
    """Per weight kind, (fp32, bf16) copies of each layer's weight: the largest row count at which
    one pass over all of them is 10% faster in fp32 than in bf16 (0: never).

    Rows are tried in increasing order and the search stops at the first count where bf16
    is not slower: products only get more compute-bound (and bf16-friendly) with rows.
    """
    return {kind: _crossover(pairs, rows) for kind, pairs in weights.items()}


def copy_crossover(in_features: int, layers: int, own: Callable[[torch.Tensor, int], object],
                   copy: Callable[[torch.Tensor, int], object], x_dtype: torch.dtype = torch.float32,
                   rows: tuple[int, ...] = CROSSOVER_ROWS) -> int:
    """The largest row count at which one pass of `copy(x, layer)` over every layer is 10% faster than the
    model's own product `own(x, layer)` (0: never): when a few-row step should read a copy of a weight kind
    (4-bit, or bf16 in an fp32 model), each layer in turn so that caches are as cold as in a real step."""
    gen = torch.Generator().manual_seed(0)

    def timings(n: int) -> tuple[float, float]:
        x = torch.randn(n, in_features, generator=gen).to(x_dtype)
        mine, theirs = time_pair(lambda: [own(x, li) for li in range(layers)],
                                 lambda: [copy(x, li) for li in range(layers)], reps=5)
        return theirs, mine

    return crossover_rows(timings, rows)


def _crossover(pairs: list[tuple[torch.Tensor, torch.Tensor]], rows: tuple[int, ...]) -> int:
    gen = torch.Generator().manual_seed(0)

    def timings(n: int) -> tuple[float, float]:
        x = torch.randn(n, pairs[0][0].shape[1], generator=gen)
        xb = x.bfloat16()
        return time_pair(lambda: [F.linear(x, w) for w, _ in pairs], lambda: [F.linear(xb, w) for _, w in pairs],
                         reps=5)

    return crossover_rows(timings, rows)


def crossover_rows(timings: Callable[[int], tuple[float, float]], rows: tuple[int, ...] = CROSSOVER_ROWS) -> int:
    """The largest row count n at which timings(n) = (candidate ms, bf16 ms) has the candidate at least
    10% faster (0: never). Rows are tried in increasing order and the search stops at the first count
    where the candidate does not win: products only get more compute-bound (bf16-friendly) with rows."""
    best = 0
    with torch.inference_mode():
        for n in rows:
            candidate, bf16 = timings(n)
            if candidate * 1.1 > bf16:
                break
            best = n
    return best
