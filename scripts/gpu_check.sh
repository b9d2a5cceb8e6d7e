#!/usr/bin/env bash
# The project's GPU checks, run ON a GPU machine from the repo root (CI has no GPU):
#
#   bash scripts/gpu_check.sh tests     # the tests that skip without CUDA, and the kernels compiled for real
#   bash scripts/gpu_check.sh kernels   # bench_tier, bench_repack, bench_scoring: kernels against a device copy
#   bash scripts/gpu_check.sh benches   # bench_pass and bench_step_hooks --device cuda, then the kernels part
#   bash scripts/gpu_check.sh engine    # benches/engine_eviction.py: SGLang's engine, eviction on vs off
#   bash scripts/gpu_check.sh tier      # the tier inside CUDA-graph replays (test), then its decode step
#                                       # against plain SGLang and eviction off (engine_eviction.py)
#   bash scripts/gpu_check.sh capture   # the GPU-backend engine test alone (triton, flashinfer)
#   bash scripts/gpu_check.sh stall     # the tier engine with SGLang's prefill CUDA graphs on (its
#                                       # capture stalled at 960 tokens on 2026-11-28), every
#                                       # thread's stack dumped each 30 s until its event loop
#                                       # starts (SGLANG_EVICT_STALL_DUMP_S); STALL_TIMEOUT_S
#   bash scripts/gpu_check.sh tier-fast # one lease's tier check in at most 8 minutes, in order:
#                                       # the tier kernels (both bodies) against a copy, the tier
#                                       # in CUDA graphs (test), its decode step against plain
#                                       # SGLang, the repack bench; each file written as its step ends
#   bash scripts/gpu_check.sh tests benches engine   # several parts, in order, one set-up
#
# GPU_CHECK_DRY_RUN=1 prints each step of tier-fast (its limit, its file, its command)
# instead of running it, and sets nothing up: what tests/test_gpu_preflight.py reads.
#
# Time limits per step (seconds): TESTS_TIMEOUT_S, ENGINE_TESTS_TIMEOUT_S (0 skips the
# GPU-backend engine test), TIER_TESTS_TIMEOUT_S, BENCH_TIMEOUT_S, ENGINE_TIMEOUT_S
# (TIER_ENGINE_TIMEOUT_S for tier's bench); BENCH_PASS_ARGS replaces
# the default bench_pass sweep's arguments.
#
# Needs SGLang 0.5.17 importable there. On a machine that has only torch and Triton
# (the lent GPU machine), build the carry folder here first and carry it along:
#   bash ../shared/gpu/build_carry.sh .gpu_carry     # SGLang 0.5.17 and its pins (cp312 wheels)
#   .whl/: the project's runtime dependencies the image lacks, as cp312 wheels (docs/performance.md, "On a GPU")
# Logs and result files go to $OUT (or /tmp/gpu_check). Each part is bounded by `timeout`.
set -uo pipefail
[ $# -gt 0 ] || { echo "usage: gpu_check.sh tests|kernels|benches|engine|tier|tier-fast|capture|stall ..." >&2; exit 2; }
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
dry=${GPU_CHECK_DRY_RUN:-0}
# step SECONDS FILE CMD...: CMD bounded by SECONDS, its output streamed into $out/FILE
# (there as the step runs, whatever cuts it); under GPU_CHECK_DRY_RUN only printed.
step() {
  local limit=$1 file=$2
  shift 2
  if [ "$dry" = 1 ]; then
    echo "step $limit $file $*"
    return 0
  fi
  timeout "$limit" "$@" 2>&1 | tee "$out/$file"
}
if [ "$dry" != 1 ]; then
if [ -f .gpu_carry/env.sh ]; then
  . .gpu_carry/env.sh
fi
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
# Triton's compiled kernels, carried from one lease to the next: a fresh machine spent
# 64-75 s compiling inside its first engine's graph capture (2026-11-28). Triton keys
# each entry by its source, options, Triton version and GPU architecture, so an entry
# from another card or release is never used. The run leaves the cache in
# $out/gpu_triton_cache.tgz; carry it back as .gpu_triton_cache.tgz (git ignores it).
triton_cache=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
if [ -f .gpu_triton_cache.tgz ]; then
  mkdir -p "$triton_cache" && tar -xzf .gpu_triton_cache.tgz -C "$triton_cache" \
    && echo "Triton cache restored: $(du -sh "$triton_cache" | cut -f1)"
fi
save_triton_cache() {
  [ -d "$triton_cache" ] || return 0
  tar -czf "$out/gpu_triton_cache.tgz" -C "$triton_cache" . 2>/dev/null
  local mib=$(( $(stat -c %s "$out/gpu_triton_cache.tgz") / 1048576 ))
  if [ "$mib" -gt "${TRITON_CACHE_MAX_MIB:-40}" ]; then  # a carry holds 64 MiB in all
    rm -f "$out/gpu_triton_cache.tgz"
    echo "Triton cache not kept: $mib MiB (TRITON_CACHE_MAX_MIB)"
  fi
}
trap save_triton_cache EXIT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, sglang; print('torch', torch.__version__, 'triton', triton.__version__, 'sglang', sglang.__version__)"
fi

# $MODEL (default /tmp/llama_rand) into $model, made with MODEL_ARGS' shape when missing
# (not under GPU_CHECK_DRY_RUN).
random_model() {
  model=${MODEL:-/tmp/llama_rand}
  [ "$dry" = 1 ] || [ -f "$model/config.json" ] \
    || python3 scripts/make_random_llama.py "$model" ${MODEL_ARGS:-}
}

kernel_benches() {
  local t=${BENCH_TIMEOUT_S:-240}
  # both attention bodies (grouped, words) and their variants, on both shapes
  timeout "$t" python3 benches/bench_tier.py 2>&1 | tee "$out/bench_tier.txt"
  timeout "$t" python3 benches/bench_tier.py --shape smollm2 2>&1 | tee "$out/bench_tier_smollm2.txt"
  timeout "$t" python3 benches/bench_repack.py 2>&1 | tee "$out/bench_repack.txt"
  timeout "$t" python3 benches/bench_scoring.py 2>&1 | tee "$out/bench_scoring.txt"
}

for part in "$@"; do
case "$part" in
capture)
  timeout "${ENGINE_TESTS_TIMEOUT_S:-300}" python3 -m pytest -q -p no:cacheprovider -n 0 -ra \
    "tests/test_engine_capture.py::test_gpu_backend_captures_queries_inside_cuda_graph_replays" \
    2>&1 | tee "$out/pytest_gpu_engine.log"
  ;;
tier)
  # The tier's passes on CUDA = on CPU (no engine); its merge recorded into SGLang's
  # decode CUDA graphs: graphs on = graphs off, and not what eviction alone generates.
  timeout "${TIER_TESTS_TIMEOUT_S:-300}" python3 -m pytest -q -p no:cacheprovider -n 0 -ra \
    "tests/test_tier_mechanism.py::test_tier_passes_on_a_gpu_equal_the_cpus" \
    "tests/test_engine_tier_triton.py::test_the_tier_merges_inside_cuda_graph_replays_on_a_gpu" \
    2>&1 | tee "$out/pytest_gpu_tier.log"
  # Its decode step: plain SGLang in one engine, the tier (3 bits, eager passes) in
  # another, alternating with eviction off per request in that one (--paired).
  random_model || exit 1
  logs=$(mktemp -d)
  # no engine starts unless every mode's would (a failed preflight skips the bench)
  # shellcheck disable=SC2086
  if python3 benches/engine_eviction.py --model "$model" ${TIER_ENGINE_ARGS:---modes plain,on+tier} \
    --preflight 2>&1 | tee "$out/engine_tier_preflight.txt"; then
    timeout "${TIER_ENGINE_TIMEOUT_S:-300}" python3 benches/engine_eviction.py --model "$model" \
      --out "$logs/engine_tier.json" ${TIER_ENGINE_ARGS:---modes plain,on+tier --repeats 3 --paired} \
      2>&1 | tee "$out/engine_tier.txt"
  fi
  cp "$logs/engine_tier.json" "$out/" 2>/dev/null
  tar -C "$logs" -czf "$out/engine_tier-logs.tar.gz" .
  ;;
tier-fast)
  # 450 s of steps (TIER_FAST_*_S) and about 30 s of set-up: 8 minutes after the machine
  # starts. The Triton cache is carried in and out (above); the engines' flags pass
  # SGLang's preflight on CPU first (tests/test_gpu_preflight.py).
  random_model || exit 1
  started=$(date +%s)
  # 1. the attention bodies (grouped, words and their variants) and the quantizer
  step "${TIER_FAST_KERNELS_S:-100}" bench_tier.txt python3 benches/bench_tier.py
  # 2. the tier's merge inside SGLang's decode CUDA graphs: graphs on = graphs off
  step "${TIER_FAST_TEST_S:-140}" pytest_gpu_tier.log python3 -m pytest -q -p no:cacheprovider \
    -n 0 -ra "tests/test_engine_tier_triton.py::test_the_tier_merges_inside_cuda_graph_replays_on_a_gpu"
  # 3. the decode step: plain SGLang, then the tier (3 bits) paired with eviction off
  step "${TIER_FAST_ENGINE_S:-150}" engine_tier.txt python3 benches/engine_eviction.py \
    --model "$model" --out "$out/engine_tier.json" --modes plain,on+tier --repeats 1 --paired \
    --out-len 512
  # 4. the repack kernel against a device copy (the goals' rows: 128 B and 2 KiB)
  step "${TIER_FAST_REPACK_S:-60}" bench_repack.txt python3 benches/bench_repack.py --quick
  [ "$dry" = 1 ] || echo "tier-fast: $(( $(date +%s) - started )) s of steps"
  ;;
stall)
  # One tier engine, prefill graphs on, one short repeat; its log (with the stack dumps)
  # comes back whether it starts or the limit cuts it.
  random_model || exit 1
  logs=$(mktemp -d)
  SGLANG_EVICT_STALL_DUMP_S=${SGLANG_EVICT_STALL_DUMP_S:-30} \
    timeout "${STALL_TIMEOUT_S:-240}" python3 benches/engine_eviction.py --model "$model" \
    --out "$logs/engine_stall.json" --modes on+tier --repeats 1 --prefill-graphs \
    2>&1 | tee "$out/engine_stall.txt"
  tar -C "$logs" -czf "$out/engine_stall-logs.tar.gz" .
  ;;
tests)
  # The kernels on CUDA tensors (compiled, programs in parallel), the pass under
  # set_sync_debug_mode("error"), the query ring in CUDA graphs, CUDA IPC to the sidecar
  # (the KV buffers, and the tier's arena it demotes into).
  timeout "${TESTS_TIMEOUT_S:-420}" python3 -m pytest -q -p no:cacheprovider -n 4 --dist loadgroup -ra \
    tests/test_kernels_tier.py tests/test_kernels_repack.py tests/test_kernels_scoring.py tests/test_batch_pass_hooks.py \
    tests/test_query_capture.py tests/test_compactor_service.py tests/test_static_shape_pass.py \
    "tests/test_tier_mechanism.py::test_tier_passes_on_a_gpu_equal_the_cpus" \
    "tests/test_compactor_demotion.py::test_gpu_the_sidecar_demotes_into_a_cuda_arena_by_ipc" \
    2>&1 | tee "$out/pytest_gpu.log"
  # SGLang's GPU attention backends with query capture inside CUDA-graph replays.
  [ "${ENGINE_TESTS_TIMEOUT_S:-300}" = 0 ] || timeout "${ENGINE_TESTS_TIMEOUT_S:-300}" python3 -m pytest -q -p no:cacheprovider -n 0 -ra \
    "tests/test_engine_capture.py::test_gpu_backend_captures_queries_inside_cuda_graph_replays" \
    2>&1 | tee "$out/pytest_gpu_engine.log"
  ;;
benches)
  t=${BENCH_TIMEOUT_S:-240}
  # shellcheck disable=SC2086
  timeout "$t" python3 benches/bench_pass.py --device cuda ${BENCH_PASS_ARGS:---profile 20} 2>&1 \
    | tee "$out/bench_pass_cuda.txt"
  # The host time a decode step's hooks cost (64 running requests, 0-64 due, replayed).
  timeout "$t" python3 benches/bench_step_hooks.py --device cuda 2>&1 \
    | tee "$out/bench_step_hooks_cuda.txt"
  [ -n "${BENCH_PASS_ARGS:-}" ] || kernel_benches
  ;;
kernels)
  kernel_benches
  ;;
engine)
  # MODEL_ARGS: make_random_llama.py's shape flags (default: 156M); ENGINE_ARGS: the
  # bench's (default: budget off, then eviction with passes replayed as CUDA graphs on
  # every step and with auto grouping, one engine each, two repeats, each evicting
  # engine also generating with eviction off per request, alternating (--paired): the
  # decode-step goal with and without grouping, measured within one engine).
  random_model || exit 1
  name=${NAME:-engine_eviction}
  logs=$(mktemp -d)
  # no engine starts unless every mode's would (a failed preflight skips the bench)
  # shellcheck disable=SC2086
  if python3 benches/engine_eviction.py --model "$model" \
    ${ENGINE_ARGS:---modes off,on:1+graph,on:auto+graph --repeats 2 --paired} --preflight 2>&1 \
    | tee "$out/${name}_preflight.txt"; then
    timeout "${ENGINE_TIMEOUT_S:-540}" python3 benches/engine_eviction.py --model "$model" \
      --out "$logs/$name.json" ${ENGINE_ARGS:---modes off,on:1+graph,on:auto+graph --repeats 2 --paired} \
      2>&1 | tee "$out/$name.txt"
  fi
  cp "$logs/$name.json" "$out/" 2>/dev/null
  tar -C "$logs" -czf "$out/$name-logs.tar.gz" .
  ;;
*)
  echo "unknown part $part: tests, kernels, benches, engine, tier, tier-fast, capture or stall" >&2
  exit 2
  ;;
esac
done
