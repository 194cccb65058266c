#!/usr/bin/env bash
# bf16 on a CUDA machine, in a few minutes (issue 12): the same runner as on a CPU, with --device cuda.
#   1. parity: tests/test_bf16.py on the GPU (tiny model; the default model too unless QUICK=1):
#      bf16 vs fp32 logits within the documented tolerance, same top-1, no clear gate flip
#   2. streamllm bench query --quick --device cuda: asks in auto (bf16 on a bf16 GPU), then fp32 and
#      bf16 side by side: prefill, decode, one session update (1 bar + 4 questions), gate decisions
# Usage: bench/gpu_check.sh [OUT_DIR]   (PYTHON=... to pick the interpreter; default: python)
# Writes OUT_DIR/gpu_check.log and OUT_DIR/query_cuda.json (default OUT_DIR: bench/out).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${1:-bench/out}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1

"$PY" - <<'PY'
import torch
assert torch.cuda.is_available(), "no CUDA device: this check is for a GPU machine"
print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, bf16 {torch.cuda.is_bf16_supported()}")
PY
select=()
[ "${QUICK:-0}" = 1 ] && select=(-m "not integration")
STREAMLLM_TEST_DEVICE=cuda STREAMLLM_DTYPE=auto PYTHONPATH=$PWD \
    "$PY" -m pytest -q tests/test_bf16.py "${select[@]}"
STREAMLLM_DTYPE=auto PYTHONPATH=$PWD \
    "$PY" -m streamllm.cli bench query --quick --device cuda --json "$OUT/query_cuda.json"
echo "gpu_check: done; figures in $OUT/query_cuda.json"
