#!/usr/bin/env bash
# lmiserve against llama.cpp on the same GGUF file (the bundled SmolLM2-135M-Instruct Q4_1), in one
# `lmiserve bench` run: completion and chat scenarios at concurrency 1 and 8 (see README.md,
# "lmiserve and llama.cpp side by side"). llama.cpp is a benchmark-only peer, never a dependency of
# lmiserve: install it in its own venv first (README.md says how).
#
#   LLAMACPP_VENV   venv with llama-cpp-python[server]   (default /work/.venv-llamacpp)
#   LLAMA_SERVER    path of llama.cpp's C++ llama-server (optional; default: none)
#   LMISERVE        the lmiserve command                 (default: lmiserve)
#   OUT             output directory                     (default bench-results/llamacpp-<UTC time>)
#   any arguments are added to `lmiserve bench` (e.g. --dtype bf16, --concurrency 1,8,32)
set -euo pipefail

LLAMACPP_VENV=${LLAMACPP_VENV:-/work/.venv-llamacpp}
LMISERVE=${LMISERVE:-lmiserve}
OUT=${OUT:-bench-results/llamacpp-$(date -u +%Y%m%d-%H%M%S)}
THREADS=${THREADS:-2}
PY_PORT=${PY_PORT:-18081}
CPP_PORT=${CPP_PORT:-18082}
mkdir -p "$OUT"

GGUF=$(python -c "from lmiserve.models import bundled_gguf_path; print(bundled_gguf_path())")
echo "GGUF: $GGUF"
pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

wait_ready() {  # url
  for _ in $(seq 1 600); do
    if curl -fs "$1/v1/models" >/dev/null 2>&1; then return 0; fi
    sleep 0.5
  done
  echo "$1 did not start" >&2
  return 1
}

# llama-cpp-python's OpenAI server: one Llama object behind a lock, so requests run one at a time
# (no parallel slots); interrupt_requests=false, or a new request cuts the streaming one short.
"$LLAMACPP_VENV/bin/python" -m llama_cpp.server --model "$GGUF" --host 127.0.0.1 --port "$PY_PORT" \
  --n_ctx 4096 --n_threads "$THREADS" --n_threads_batch "$THREADS" --interrupt_requests false \
  >"$OUT/llama-cpp-python.log" 2>&1 &
pids+=($!)
compare=(--compare-url "http://127.0.0.1:$PY_PORT" --compare-name llama-cpp-python)

# llama.cpp's C++ server (same vendored sources), which does have parallel slots and continuous batching
if [[ -n "${LLAMA_SERVER:-}" ]]; then
  "$LLAMA_SERVER" -m "$GGUF" --host 127.0.0.1 --port "$CPP_PORT" -t "$THREADS" -tb "$THREADS" \
    -np 8 -c 32768 >"$OUT/llama-server.log" 2>&1 &
  pids+=($!)
  compare+=(--compare-url "http://127.0.0.1:$CPP_PORT" --compare-name llama-server)
fi

wait_ready "http://127.0.0.1:$PY_PORT"
[[ -n "${LLAMA_SERVER:-}" ]] && wait_ready "http://127.0.0.1:$CPP_PORT"

{ date -u; uptime; lscpu | grep 'Model name'; } | tee "$OUT/machine.txt"
$LMISERVE bench --scenario both --concurrency 1,8 --max-new-tokens 64 --chat-turns 4 \
  --chat-conversations 1 --skip-baselines "${compare[@]}" --output-dir "$OUT" "$@" | tee "$OUT/bench.txt" \
  || status=$?
{ date -u; uptime; } | tee -a "$OUT/machine.txt"
exit "${status:-0}"
