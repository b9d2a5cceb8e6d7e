#!/usr/bin/env bash
# Supervisor of the compactor and the SGLang server in one container: the compactor
# placement `inContainer`, needed because the NVIDIA device plugin gives a GPU to one
# container only.
#
#   supervisor.sh COMPACTOR_COMMAND... -- SERVER_COMMAND...
#
# Starts the compactor, waits for its Unix socket ($SGLANG_EVICT_COMPACTOR_SOCKET, at
# most $SGLANG_EVICT_SOCKET_WAIT_S seconds), starts the server, then watches both. When
# either exits, the other is stopped and the script exits non-zero, so that Kubernetes
# restarts the container. On SIGTERM/SIGINT (pod shutdown) both are stopped and the
# script exits 0. A process still running $SGLANG_EVICT_STOP_TIMEOUT_S seconds after
# SIGTERM gets SIGKILL.
set -uo pipefail

log() { printf 'supervisor: %s\n' "$*" >&2; }
usage() {
  log "usage: supervisor.sh COMPACTOR_COMMAND... -- SERVER_COMMAND..."
  exit 2
}

socket="${SGLANG_EVICT_COMPACTOR_SOCKET:?SGLANG_EVICT_COMPACTOR_SOCKET must name the compactor socket}"
wait_s="${SGLANG_EVICT_SOCKET_WAIT_S:-120}"
stop_timeout_s="${SGLANG_EVICT_STOP_TIMEOUT_S:-30}"

compactor_cmd=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  compactor_cmd+=("$1")
  shift
done
[ ${#compactor_cmd[@]} -gt 0 ] && [ $# -gt 1 ] || usage
shift # the "--"

compactor_pid=""
server_pid=""
stopping=""

alive() { [ -n "$1" ] && kill -0 "$1" 2>/dev/null; }

# SIGTERM both, give them stop_timeout_s to exit, SIGKILL what is left, exit with $1.
stop_and_exit() {
  local pid deadline=$((SECONDS + stop_timeout_s))
  for pid in "$server_pid" "$compactor_pid"; do
    alive "$pid" && kill -TERM "$pid" 2>/dev/null
  done
  while alive "$server_pid" || alive "$compactor_pid"; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      log "still running ${stop_timeout_s}s after SIGTERM; sending SIGKILL"
      for pid in "$server_pid" "$compactor_pid"; do
        alive "$pid" && kill -KILL "$pid" 2>/dev/null
      done
      break
    fi
    sleep 0.2
  done
  exit "$1"
}

on_signal() {
  stopping=1
  log "termination requested; stopping the server and the compactor"
}
trap on_signal TERM INT

rm -f "$socket"
"${compactor_cmd[@]}" &
compactor_pid=$!
log "compactor started (pid $compactor_pid); waiting up to ${wait_s}s for $socket"

deadline=$((SECONDS + wait_s))
until [ -S "$socket" ]; do
  [ -z "$stopping" ] || stop_and_exit 0
  if ! alive "$compactor_pid"; then
    wait "$compactor_pid"
    log "compactor exited (status $?) before opening $socket"
    exit 1
  fi
  if [ "$SECONDS" -ge "$deadline" ]; then
    log "compactor did not open $socket within ${wait_s}s"
    stop_and_exit 1
  fi
  sleep 0.2
done

"$@" &
server_pid=$!
log "compactor socket ready; server started (pid $server_pid)"

while :; do
  wait -n # returns when a child exits, or early when a trapped signal arrives
  status=$?
  [ -z "$stopping" ] || stop_and_exit 0
  if ! alive "$compactor_pid"; then
    log "compactor exited (status $status); stopping the server, the container restarts"
    stop_and_exit 1
  fi
  if ! alive "$server_pid"; then
    log "server exited (status $status); stopping the compactor, the container restarts"
    stop_and_exit 1
  fi
done
