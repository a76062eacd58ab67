#!/usr/bin/env bash
# Start one prefill engine, one decode engine and the router on 127.0.0.1.
#
#   launch/pd_pair.sh [--model DIR] [--router-port N] [--prefill-port N] [--decode-port N]
#                     [--ready-timeout-s S] [-- extra engine flags]
#
# Creates .venv when it is missing (via `make venv`), serves the built-in default model
# when --model is not given, gives each engine one torch thread (P and D share the
# machine's cores), waits until the router's /ready answers, prints the router URL and a
# curl to paste, stays in the foreground and stops all three on Ctrl-C or SIGTERM.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODEL=""
ROUTER_PORT=8000
PREFILL_PORT=8100
DECODE_PORT=8200
READY_TIMEOUT_S=300
EXTRA=()

usage() { sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) MODEL="$2"; shift 2 ;;
    --router-port) ROUTER_PORT="$2"; shift 2 ;;
    --prefill-port) PREFILL_PORT="$2"; shift 2 ;;
    --decode-port) DECODE_PORT="$2"; shift 2 ;;
    --ready-timeout-s) READY_TIMEOUT_S="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "pd_pair.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done

cd "$ROOT"
# A venv made by `make venv` has .installed; one made by hand counts if it imports the stack.
if [[ ! -f .venv/.installed ]] && ! .venv/bin/python -c "import torch, aiohttp, zmq, msgspec, atomd" 2>/dev/null; then
  echo "pd_pair.sh: creating the virtualenv (.venv) ..." >&2
  make venv
fi
PY="$ROOT/.venv/bin/python"
MODEL_ARGS=()
[[ -n "$MODEL" ]] && MODEL_ARGS=(--model "$MODEL")

# A fresh secret shared by the three: the router signs the kv_transfer_params it sends D,
# and D pulls only for params signed with it (docs/design.md "Trust").
SECRET_DIR="$(mktemp -d "${TMPDIR:-/tmp}/atomd-pd-pair.XXXXXX")"
SECRET_FILE="$SECRET_DIR/kv-params-secret"
(umask 077 && "$PY" -c "import secrets; print(secrets.token_hex(32))" > "$SECRET_FILE")

PIDS=()
cleanup() {
  trap - INT TERM EXIT
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  # Give each process a few seconds to exit cleanly, then force it.
  for _ in $(seq 50); do
    alive=0
    for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [[ $alive == 0 ]] && break
    sleep 0.1
  done
  for pid in "${PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$SECRET_DIR"
}
trap 'cleanup; exit 130' INT
trap 'cleanup; exit 143' TERM
trap cleanup EXIT

"$PY" -m atomd serve "${MODEL_ARGS[@]}" --host 127.0.0.1 --port "$PREFILL_PORT" \
  --kv-role producer --num-threads 1 --kv-params-secret-file "$SECRET_FILE" "${EXTRA[@]}" &
PIDS+=($!)
"$PY" -m atomd serve "${MODEL_ARGS[@]}" --host 127.0.0.1 --port "$DECODE_PORT" \
  --kv-role consumer --num-threads 1 --kv-params-secret-file "$SECRET_FILE" "${EXTRA[@]}" &
PIDS+=($!)
"$PY" -m router --host 127.0.0.1 --port "$ROUTER_PORT" \
  --prefill "http://127.0.0.1:$PREFILL_PORT" --decode "http://127.0.0.1:$DECODE_PORT" \
  --kv-params-secret-file "$SECRET_FILE" &
PIDS+=($!)

URL="http://127.0.0.1:$ROUTER_PORT"
deadline=$((SECONDS + READY_TIMEOUT_S))
until "$PY" - "$URL/ready" <<'PYEOF' 2>/dev/null
import sys, urllib.request
sys.exit(0 if urllib.request.urlopen(sys.argv[1], timeout=2).status == 200 else 1)
PYEOF
do
  for pid in "${PIDS[@]}"; do
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "pd_pair.sh: a process exited before the pair was ready (pid $pid)" >&2
      exit 1
    fi
  done
  if (( SECONDS > deadline )); then
    echo "pd_pair.sh: not ready after ${READY_TIMEOUT_S}s" >&2
    exit 1
  fi
  sleep 0.5
done

cat <<MSG
atomd PD pair ready: $URL   (prefill :$PREFILL_PORT, decode :$DECODE_PORT)
Try:
  curl -s $URL/v1/completions -H 'Content-Type: application/json' \\
    -d '{"prompt": "def fibonacci(n):", "max_tokens": 32, "temperature": 0}'
Ctrl-C stops all three.
MSG

# Stay in the foreground; if any of the three dies, stop the others.
wait -n "${PIDS[@]}" || true
echo "pd_pair.sh: a process exited; stopping the pair" >&2
exit 1
