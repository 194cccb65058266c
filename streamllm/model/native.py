"""The native decode step: one sequence, one new token, every layer in one C++ call.

A decode step from 4-bit weights is a row of a few hundred floats between products; in
Python each layer pays ~40 tensor ops and a gathered attention for it. `csrc/decode_step.cpp`
runs the layers with the same products (ATen's 4-bit kernel), loops for the small ops and
an attention that reads the sequence's runs of cells in place.

It is built once per machine with torch's C++ extension builder (a C++ compiler is needed;
ninja speeds it up) into the model home (`$STREAMLLM_HOME/native/`), for the vector
instructions this CPU has, and loaded on later runs. Where it cannot be built or
`STREAMLLM_NATIVE=0`, `load()` returns None and the Python forward runs every step: both
compute the same step (tests/test_native.py compares them).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

from streamllm.model.checkpoint import streamllm_home

SOURCE = Path(__file__).parent / "csrc" / "decode_step.cpp"
# Vector instructions per torch's CPU capability: the build runs only on a CPU that has them.
_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"]
ARCH_FLAGS = {"AVX512BF16": [*_AVX512, "-mavx512bf16"], "AVX512": _AVX512, "AVX2": ["-mavx2", "-mfma"]}

log = logging.getLogger(__name__)
_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}


def enabled() -> bool:
    """False when STREAMLLM_NATIVE=0 (the Python forward runs every step)."""
    return os.environ.get("STREAMLLM_NATIVE", "1") != "0"


def capability() -> str:
    """The vector instructions the build may use here: torch's CPU capability, and "BF16" where
    AVX-512 has its bf16 dot product (attention's scores then stay bf16, as the Python path's kernel)."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap == "AVX512" and getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)():
        return "AVX512BF16"
    return cap


def build_name() -> str:
    """The module's name: a hash of the sources (this file holds the flags), torch's version and the
    CPU's capability, so a changed source, another torch or another CPU never loads an old build."""
    cap = capability()
    digest = hashlib.sha256(SOURCE.read_bytes() + Path(__file__).read_bytes() + torch.__version__.encode()
                            + cap.encode()).hexdigest()[:12]
    return f"streamllm_decode_{cap.lower()}_{digest}"


def load() -> ModuleType | None:
    """The compiled module (built on first use), or None where it cannot be had (logged once)."""
    if not enabled():
        return None
    if not SOURCE.is_file():
        log.warning("native decode step unavailable, decoding in Python: %s is missing", SOURCE)
        return None
    name = build_name()
    with _lock:
        if name not in _loaded:
            _loaded[name] = _build(name)
        return _loaded[name]


def _build(name: str) -> ModuleType | None:
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # torch's builder runs `ninja` from PATH; the ninja wheel has one
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
    directory = streamllm_home() / "native" / name
    # -fopenmp: at::parallel_for is OpenMP inlined from ATen's headers, so without it the step runs on one
    # thread. The module then needs libgomp.so.1, which resolves to the copy torch has loaded already
    # (the same soname): one OpenMP pool in the process, as torch's ops use.
    flags = ["-O3", "-fopenmp", *ARCH_FLAGS.get(capability(), [])]
    started = time.perf_counter()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fresh = not any(directory.glob("*.so"))
        if fresh:
            print(f"building the native decode step once ({directory}) ...", file=sys.stderr, flush=True)
        module = cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                                    build_directory=str(directory), verbose=False)
    except Exception as exc:  # no compiler or headers, a model home we cannot write: Python serves every step
        last = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
        log.warning("native decode step unavailable, decoding in Python: %s", last)
        return None
    if fresh:
        print(f"built in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return module
