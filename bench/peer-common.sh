# Sourced by bench/peer.sh and bench/peer-vllm.sh: starting a peer server fresh and waiting for it.

# stop_previous PIDFILE SECONDS: the previous run's server, whose cache must not carry over.
stop_previous() {
  if [ -f "$1" ]; then
    kill "$(cat "$1")" 2>/dev/null || true
    rm -f "$1"
    sleep "$2"
  fi
}

# wait_healthy NAME PORT PIDFILE LOG TRIES: poll /health once a second; exit 0 when up, 1 after TRIES.
wait_healthy() {
  for _ in $(seq "$5"); do
    if curl -sf "http://127.0.0.1:$2/health" >/dev/null 2>&1; then
      echo "$1 up on http://127.0.0.1:$2 (pid $(cat "$3"), log $4)"
      exit 0
    fi
    sleep 1
  done
  echo "$1 did not become healthy; see $4" >&2
  exit 1
}
