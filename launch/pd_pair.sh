#!/usr/bin/env bash
# Start one prefill engine, one decode engine and the router on 127.0.0.1.
#
#   launch/pd_pair.sh [--model DIR] [--router-port N] [--prefill-port N] [--decode-port N]
#                     [--kv-aware] [--prefill-args "FLAGS"] [--decode-args "FLAGS"]
#                     [--router-args "FLAGS"] [--log-dir DIR] [--verbose]
#                     [--ready-timeout-s S] [-- flags for both engines]
#
# Creates .venv when it is missing (via `make venv`), serves the built-in default model
# when --model is not given, gives each engine one torch thread (P and D share the
# machine's cores), waits until each of the three listens on its own port and the router's
# /ready answers, prints the router URL and a curl to paste, stays in the foreground and
# stops all three on Ctrl-C, SIGINT or SIGTERM (in the background too).
# --kv-aware: each engine publishes KV events on its own free ports and the router places
# requests with the kv_aware policy. --prefill-args / --decode-args / --router-args: more
# flags for that process alone (split on spaces). Each process writes to its own log file
# (named at start; --log-dir DIR, default a fresh temporary directory); --verbose sends
# them to the terminal instead.
set -euo pipefail

# Bash keeps a signal ignored at its start (a background job of a non-interactive shell
# starts with SIGINT ignored) and cannot trap it: run again with SIGINT at its default.
if (( 16#$(awk '/^SigIgn/ {print $2}' /proc/$$/status 2>/dev/null || echo 0) & 2 )) \
    && [[ -z "${ATOMD_PD_PAIR_REEXEC:-}" ]] && command -v python3 >/dev/null; then
  export ATOMD_PD_PAIR_REEXEC=1
  exec python3 -c 'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp("bash", ["bash", *sys.argv[1:]])' \
    "${BASH_SOURCE[0]}" "$@"
fi

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODEL=""
ROUTER_PORT=8000
PREFILL_PORT=8100
DECODE_PORT=8200
READY_TIMEOUT_S=300
KV_AWARE=0
VERBOSE=0
LOG_DIR=""
EXTRA=()
PREFILL_ARGS=()
DECODE_ARGS=()
ROUTER_ARGS=()

usage() { sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; }
need() { [[ $# -ge 2 ]] || { echo "pd_pair.sh: $1 needs a value" >&2; exit 2; }; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) need "$@"; MODEL="$2"; shift 2 ;;
    --router-port) need "$@"; ROUTER_PORT="$2"; shift 2 ;;
    --prefill-port) need "$@"; PREFILL_PORT="$2"; shift 2 ;;
    --decode-port) need "$@"; DECODE_PORT="$2"; shift 2 ;;
    --ready-timeout-s) need "$@"; READY_TIMEOUT_S="$2"; shift 2 ;;
    --prefill-args) need "$@"; read -ra PREFILL_ARGS <<< "$2"; shift 2 ;;
    --decode-args) need "$@"; read -ra DECODE_ARGS <<< "$2"; shift 2 ;;
    --router-args) need "$@"; read -ra ROUTER_ARGS <<< "$2"; shift 2 ;;
    --log-dir) need "$@"; LOG_DIR="$2"; shift 2 ;;
    --kv-aware) KV_AWARE=1; shift ;;
    --verbose) VERBOSE=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "pd_pair.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
for flag in router prefill decode; do
  var="${flag^^}_PORT"
  [[ "${!var}" =~ ^[0-9]+$ ]] && (( ${!var} > 0 && ${!var} < 65536 )) \
    || { echo "pd_pair.sh: --$flag-port must be a port number, got '${!var}'" >&2; exit 2; }
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

# A port someone else holds: say which flag to change, before starting anything.
if ! taken=$("$PY" - "$ROUTER_PORT" "$PREFILL_PORT" "$DECODE_PORT" <<'PYEOF'
import sys
from launch.process import port_in_use
for flag, port in zip(("--router-port", "--prefill-port", "--decode-port"), map(int, sys.argv[1:])):
    if port_in_use(port):
        print(f"port {port} on 127.0.0.1 is in use by another process; pick a free one with {flag}")
        sys.exit(1)
PYEOF
); then
  echo "pd_pair.sh: $taken" >&2
  exit 2
fi

if [[ $KV_AWARE == 1 ]]; then
  # Each engine its own PUB and replay ports; the router reads them from the engines.
  read -r KV_P KV_PR KV_D KV_DR <<< "$("$PY" -c '
from launch.process import free_port
ports = set()
while len(ports) < 4:
    ports.add(free_port())
print(*ports)')"
  PREFILL_ARGS=(--kv-events-endpoint "tcp://127.0.0.1:$KV_P" --kv-events-replay-endpoint "tcp://127.0.0.1:$KV_PR"
                "${PREFILL_ARGS[@]}")
  DECODE_ARGS=(--kv-events-endpoint "tcp://127.0.0.1:$KV_D" --kv-events-replay-endpoint "tcp://127.0.0.1:$KV_DR"
               "${DECODE_ARGS[@]}")
  ROUTER_ARGS=(--policy kv_aware "${ROUTER_ARGS[@]}")
fi

if [[ $VERBOSE == 0 ]]; then
  [[ -n "$LOG_DIR" ]] || LOG_DIR="$(mktemp -d "${TMPDIR:-/tmp}/atomd-pd-pair-logs.XXXXXX")"
  mkdir -p "$LOG_DIR"
  echo "pd_pair.sh: logs: $LOG_DIR/prefill.log $LOG_DIR/decode.log $LOG_DIR/router.log"
fi
# Where a process's output goes: its log file, or the terminal with --verbose.
log_of() { if [[ $VERBOSE == 1 ]]; then echo /dev/stderr; else echo "$LOG_DIR/$1.log"; fi; }

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

NAMES=(prefill decode router)
PORTS=("$PREFILL_PORT" "$DECODE_PORT" "$ROUTER_PORT")
"$PY" -m atomd serve "${MODEL_ARGS[@]}" --host 127.0.0.1 --port "$PREFILL_PORT" \
  --kv-role producer --num-threads 1 --kv-params-secret-file "$SECRET_FILE" "${EXTRA[@]}" \
  "${PREFILL_ARGS[@]}" >"$(log_of prefill)" 2>&1 &
PIDS+=($!)
"$PY" -m atomd serve "${MODEL_ARGS[@]}" --host 127.0.0.1 --port "$DECODE_PORT" \
  --kv-role consumer --num-threads 1 --kv-params-secret-file "$SECRET_FILE" "${EXTRA[@]}" \
  "${DECODE_ARGS[@]}" >"$(log_of decode)" 2>&1 &
PIDS+=($!)
"$PY" -m router --host 127.0.0.1 --port "$ROUTER_PORT" \
  --prefill "http://127.0.0.1:$PREFILL_PORT" --decode "http://127.0.0.1:$DECODE_PORT" \
  --kv-params-secret-file "$SECRET_FILE" "${ROUTER_ARGS[@]}" >"$(log_of router)" 2>&1 &
PIDS+=($!)

URL="http://127.0.0.1:$ROUTER_PORT"
deadline=$((SECONDS + READY_TIMEOUT_S))
# Ready: each of the three holds its own listening socket (a server someone else runs on
# the same port does not count), and the router's /ready answers 200.
until "$PY" - "$URL/ready" "${PIDS[0]}:$PREFILL_PORT" "${PIDS[1]}:$DECODE_PORT" "${PIDS[2]}:$ROUTER_PORT" \
    <<'PYEOF' 2>/dev/null
import sys, urllib.request
from launch.process import listens_on
for pid_port in sys.argv[2:]:
    pid, port = map(int, pid_port.split(":"))
    if not listens_on(pid, port):
        sys.exit(1)
sys.exit(0 if urllib.request.urlopen(sys.argv[1], timeout=2).status == 200 else 1)
PYEOF
do
  for i in 0 1 2; do
    if ! kill -0 "${PIDS[$i]}" 2>/dev/null; then
      name="${NAMES[$i]}"
      log="$(log_of "$name")"
      if [[ -f "$log" ]] && grep -q "is in use" "$log"; then
        echo "pd_pair.sh: port ${PORTS[$i]} on 127.0.0.1 is in use by another process; pick a free one with --$name-port" >&2
      else
        last=""
        [[ -f "$log" ]] && last="$(grep -v '^\s*$' "$log" | tail -n 1)"
        echo "pd_pair.sh: the $name process exited before the pair was ready${last:+: $last}${LOG_DIR:+ (log: $log)}" >&2
      fi
      exit 2
    fi
  done
  if (( SECONDS > deadline )); then
    echo "pd_pair.sh: not ready after ${READY_TIMEOUT_S}s${LOG_DIR:+ (logs in $LOG_DIR)}" >&2
    exit 1
  fi
  sleep 0.5
done

cat <<MSG
atomd PD pair ready: $URL   (prefill :$PREFILL_PORT, decode :$DECODE_PORT$([[ $KV_AWARE == 1 ]] && echo ", kv_aware"))
Try:
  curl -s $URL/v1/completions -H 'Content-Type: application/json' \\
    -d '{"prompt": "def fibonacci(n):", "max_tokens": 32, "temperature": 0}'
Ctrl-C stops all three.
MSG

# Stay in the foreground; if any of the three dies, stop the others.
wait -n "${PIDS[@]}" || true
echo "pd_pair.sh: a process exited; stopping the pair" >&2
exit 1
