#!/usr/bin/env bash
# Liveness probe of the SGLang container when the compactor runs inside it (placement
# `inContainer`). Kubernetes allows one liveness probe per container, so this one
# checks both processes: SGLang's HTTP health endpoint, then the compactor's gRPC
# health service (`sglang-evict compactor-health`). Exits non-zero, naming the
# unhealthy process, when either check fails. (A process that exits is caught sooner,
# by the supervisor; this catches a hung one.)
set -uo pipefail

port="${SGLANG_EVICT_HTTP_PORT:?SGLANG_EVICT_HTTP_PORT must name the server port}"
path="${SGLANG_EVICT_HEALTH_PATH:-/health}"
socket="${SGLANG_EVICT_COMPACTOR_SOCKET:?SGLANG_EVICT_COMPACTOR_SOCKET must name the compactor socket}"
http_timeout_s="${SGLANG_EVICT_HTTP_TIMEOUT_S:-5}"

if ! python3 - "http://127.0.0.1:${port}${path}" "$http_timeout_s" <<'PY'; then
import sys
import urllib.request

url, timeout_s = sys.argv[1], float(sys.argv[2])
try:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        sys.exit(0 if response.status == 200 else 1)
except Exception as error:  # HTTP 503 while starting or stopping, refused, timed out
    print(f"GET {url}: {error}", file=sys.stderr)
    sys.exit(1)
PY
  echo "liveness: SGLang ${path} failed" >&2
  exit 1
fi
if ! sglang-evict compactor-health --socket "$socket"; then
  echo "liveness: compactor gRPC health at ${socket} is not SERVING" >&2
  exit 1
fi
