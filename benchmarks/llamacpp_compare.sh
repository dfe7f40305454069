#!/usr/bin/env bash
# lmiserve (dtype=int4) against llama.cpp's C++ llama-server on the same GGUF file (the bundled
# SmolLM2-135M-Instruct Q4_1), issue #41. llama.cpp is a benchmark-only peer, never a dependency of
# lmiserve. Every level is one `lmiserve bench --url ... --compare-url ...` run: the two servers are
# measured in turn on the same machine, completions with forced tokens (ignore_eos, max = min tokens).
#
#   MODE=levels (default)  for each concurrency C in $LEVELS: a llama-server with -np C and -c 2048*C,
#                          beside one lmiserve server (--dtype int4) kept up over all levels;
#                          results in $OUT/c<C>/
#   MODE=busy              one stream, idle ($OUT/c1-idle/) then with a busy neighbour
#                          (taskset -c $BUSY_CORE sh -c 'while :; do :; done') ($OUT/c1-busy/), both
#                          servers, same servers, same run
#   MODE=cpu1              one stream on one CPU: both servers pinned with taskset -c 0 and one thread
#                          each, the bench client on core 1 ($OUT/c1-core0/); then, where this process may
#                          make a cgroup with a 1-CPU quota (cgroup v2 cpu.max "100000 100000" or v1
#                          cpu.cfs_quota_us = cfs_period_us = 100000), both servers in it, unpinned, with
#                          $CG_THREADS threads, as in a container run with `docker run --cpus 1`
#                          ($OUT/c1-cgroup/). Where no cgroup can be made (most containers), run the
#                          container case by hand: `docker run --cpus 1 ...` with MODE=levels LEVELS=1.
#   MODE=build             only find or build llama-server, print its path and version
#
# llama-server: $LLAMA_SERVER, else `llama-server` on PATH, else $LLAMACPP_BUILD/bin/llama-server, else
# built there from the llama.cpp sources llama-cpp-python vendors (pip download of its sdist into
# $LLAMACPP_SRC; cmake + ninja, only the llama-server target, -DGGML_NATIVE=OFF with the ISA options
# /proc/cpuinfo has: SSE4.2/AVX/AVX2/FMA/F16C/BMI2, AVX-512 F/CD/VL/DQ/BW, VBMI, VNNI, BF16, AVX-VNNI;
# AMX always off: a GGML_NATIVE build dies with SIGILL on the Intel machines once it uses AMX tiles).
#
#   LEVELS          concurrencies of MODE=levels             (default "1 8 32")
#   TOKENS          forced new tokens per request            (default 64)
#   THREADS         threads of llama-server (-t, -tb)        (default: nproc; lmiserve picks its own from
#                                                             the affinity mask and a cgroup CPU quota)
#   CG_THREADS      llama-server threads in the cgroup run   (default $THREADS: what a server sees in a
#                   `--cpus 1` container; when 1, lmiserve also gets OMP_NUM_THREADS=1)
#   BUSY_CORE       core of the busy loop in MODE=busy       (default 1)
#   LMISERVE        the lmiserve command                     (default: the repository's .venv/bin/lmiserve,
#                                                             else lmiserve on PATH)
#   GGUF            the GGUF both servers serve              (default: the bundled SmolLM2-135M Q4_1)
#   LLAMA_SERVER    llama.cpp's llama-server binary          (default: found or built, see above)
#   LLAMACPP_BUILD  build (cache) folder of llama-server     (default /work/llamacpp-build)
#   LLAMACPP_SRC    where the sdist is downloaded/unpacked   (default /work/llamacpp-src)
#   LLAMACPP_PY_VERSION  llama-cpp-python version to take the sources of (default: the newest)
#   JOBS            build jobs (the build runs under nice -n 19) (default 2)
#   OUT             output directory                         (default bench-results/llamacpp-<UTC time>)
#   any arguments are added to every `lmiserve bench` run (e.g. --requests-per-client 4, --duration 30)
#
# Examples:
#   benchmarks/llamacpp_compare.sh                                     # c1, c8, c32, 64 forced tokens
#   LEVELS=1 TOKENS=16 benchmarks/llamacpp_compare.sh --requests-per-client 2 --warmup 1
#   MODE=busy benchmarks/llamacpp_compare.sh --requests-per-client 8
#   MODE=cpu1 benchmarks/llamacpp_compare.sh --requests-per-client 8
# Output: $OUT/<run>/bench.json (and bench.png, bench.txt), server logs, machine.txt, summary.txt/.json.
set -euo pipefail

MODE=${MODE:-levels}
LEVELS=${LEVELS:-1 8 32}
TOKENS=${TOKENS:-64}
THREADS=${THREADS:-$(nproc)}
CG_THREADS=${CG_THREADS:-$THREADS}
BUSY_CORE=${BUSY_CORE:-1}
LLAMACPP_BUILD=${LLAMACPP_BUILD:-/work/llamacpp-build}
LLAMACPP_SRC=${LLAMACPP_SRC:-/work/llamacpp-src}
JOBS=${JOBS:-2}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -z "${LMISERVE:-}" ]]; then
  if [[ -x "$REPO/.venv/bin/lmiserve" ]]; then LMISERVE=$REPO/.venv/bin/lmiserve; else LMISERVE=lmiserve; fi
fi
# the Python that runs lmiserve (for the GGUF path, pip download, free ports and the summary)
PY=$(dirname "$(command -v "$LMISERVE")")/python
[[ -x "$PY" ]] || PY=python3
BENCH_ARGS=("$@")

log() { echo "[llamacpp_compare] $*" >&2; }

# ---------------------------------------------------------------------------------------------------
# llama-server: find or build

isa_cmake_flags() {  # the ggml ISA options for this CPU; $1: the llama.cpp source folder
  local src=$1 flags opt want
  flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
  has() { local f; for f in "$@"; do [[ "$flags" == *" $f "* ]] || return 1; done; }
  local -a pairs=(
    "GGML_SSE42:sse4_2" "GGML_AVX:avx" "GGML_AVX2:avx2" "GGML_FMA:fma" "GGML_F16C:f16c" "GGML_BMI2:bmi2"
    "GGML_AVX_VNNI:avx_vnni"
    "GGML_AVX512:avx512f avx512cd avx512vl avx512dq avx512bw"  # ggml's AVX512 = -mavx512{f,cd,vl,dq,bw}
    "GGML_AVX512_VBMI:avx512f avx512vbmi" "GGML_AVX512_VNNI:avx512f avx512_vnni"
    "GGML_AVX512_BF16:avx512f avx512_bf16"
  )
  echo "-DGGML_NATIVE=OFF"
  for pair in "${pairs[@]}"; do
    opt=${pair%%:*} want=${pair#*:}
    if ! grep -q "option(${opt} " "$src/ggml/CMakeLists.txt"; then
      log "warning: the vendored ggml has no option $opt (renamed?); not set"
      continue
    fi
    # shellcheck disable=SC2086
    if has $want; then echo "-D$opt=ON"; else echo "-D$opt=OFF"; fi
  done
  for opt in GGML_AMX_TILE GGML_AMX_INT8 GGML_AMX_BF16; do  # never AMX (SIGILL in these VMs)
    grep -q "option(${opt} " "$src/ggml/CMakeLists.txt" && echo "-D$opt=OFF"
  done
  return 0
}

build_llama_server() {  # builds $LLAMACPP_BUILD/bin/llama-server from llama-cpp-python's vendored llama.cpp
  local sdist src t0
  t0=$(date +%s)
  mkdir -p "$LLAMACPP_SRC"
  sdist=$(ls -t "$LLAMACPP_SRC"/llama_cpp_python-*.tar.gz 2>/dev/null | head -1 || true)
  if [[ -z "$sdist" || -n "${LLAMACPP_PY_VERSION:-}" ]]; then
    log "downloading llama-cpp-python's sources into $LLAMACPP_SRC"
    "$PY" -m pip download --no-deps --no-binary :all: -d "$LLAMACPP_SRC" \
      "llama-cpp-python${LLAMACPP_PY_VERSION:+==$LLAMACPP_PY_VERSION}" >&2
    if [[ -n "${LLAMACPP_PY_VERSION:-}" ]]; then
      sdist=$LLAMACPP_SRC/llama_cpp_python-$LLAMACPP_PY_VERSION.tar.gz
    else
      sdist=$(ls -t "$LLAMACPP_SRC"/llama_cpp_python-*.tar.gz | head -1)
    fi
  fi
  src=$LLAMACPP_SRC/$(basename "$sdist" .tar.gz)/vendor/llama.cpp
  [[ -f "$src/CMakeLists.txt" ]] || tar -xzf "$sdist" -C "$LLAMACPP_SRC"
  [[ -f "$src/CMakeLists.txt" ]] || { log "no vendor/llama.cpp in $sdist"; return 1; }
  local -a isa
  mapfile -t isa < <(isa_cmake_flags "$src")
  log "building llama-server from $src into $LLAMACPP_BUILD: ${isa[*]}"
  nice -n 19 cmake -S "$src" -B "$LLAMACPP_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_CCACHE=OFF "${isa[@]}" >&2
  nice -n 19 cmake --build "$LLAMACPP_BUILD" --target llama-server -j "$JOBS" >&2
  log "built $LLAMACPP_BUILD/bin/llama-server in $(($(date +%s) - t0)) s"
}

find_llama_server() {  # prints the path of llama-server, building it when there is none
  if [[ -n "${LLAMA_SERVER:-}" ]]; then echo "$LLAMA_SERVER"; return; fi
  if command -v llama-server >/dev/null 2>&1; then command -v llama-server; return; fi
  if [[ ! -x "$LLAMACPP_BUILD/bin/llama-server" ]]; then build_llama_server; fi
  echo "$LLAMACPP_BUILD/bin/llama-server"
}

LLAMA_SERVER=$(find_llama_server)
LLAMA_VERSION=$("$LLAMA_SERVER" --version 2>&1 | grep -m1 -i 'version' || echo unknown)
log "llama-server: $LLAMA_SERVER ($LLAMA_VERSION)"
if [[ "$MODE" == build ]]; then echo "$LLAMA_SERVER"; exit 0; fi

# ---------------------------------------------------------------------------------------------------
# servers

GGUF=${GGUF:-$("$PY" -c "from lmiserve.models import bundled_gguf_path; print(bundled_gguf_path())")}
OUT=${OUT:-bench-results/llamacpp-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
log "GGUF: $GGUF; output: $OUT"

free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

LMI_PID='' CPP_PID='' BUSY_PID='' CGROUP=''
stop_pid() {  # SIGTERM the process, SIGKILL after 20 s
  local pid=$1
  [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null || return 0
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null || true
}
cleanup() {
  stop_pid "$BUSY_PID"; stop_pid "$CPP_PID"; stop_pid "$LMI_PID"
  if [[ -n "$CGROUP" ]]; then rmdir "$CGROUP" 2>/dev/null || log "could not remove the cgroup $CGROUP"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

wait_ready() {  # url path pid name: until GET url/path answers 200
  local i
  for i in $(seq 1 1200); do
    if curl -fs -o /dev/null "$1$2"; then return 0; fi
    if ! kill -0 "$3" 2>/dev/null; then log "$4 exited before it was ready (see its log in $OUT)"; return 1; fi
    sleep 0.5
  done
  log "$4 did not answer $1$2 within 600 s"
  return 1
}

# start_lmiserve tag [prefix...]: lmiserve serve on a free port, run through the prefix (taskset, env...)
start_lmiserve() {
  local tag=$1; shift
  local port; port=$(free_port)
  LMI_URL=http://127.0.0.1:$port
  "$@" "$LMISERVE" serve --model-id "$GGUF" --dtype int4 --device cpu --host 127.0.0.1 --port "$port" \
    --grpc-port 0 >"$OUT/lmiserve-$tag.log" 2>&1 &
  LMI_PID=$!
  log "lmiserve ($tag) pid $LMI_PID at $LMI_URL"
  wait_ready "$LMI_URL" /ping "$LMI_PID" lmiserve
}

# start_llama tag np threads [prefix...]: llama-server with np slots of 2048 tokens each
start_llama() {
  local tag=$1 np=$2 threads=$3; shift 3
  local port; port=$(free_port)
  CPP_URL=http://127.0.0.1:$port
  "$@" "$LLAMA_SERVER" -m "$GGUF" --host 127.0.0.1 --port "$port" -t "$threads" -tb "$threads" \
    -np "$np" -c $((2048 * np)) >"$OUT/llama-server-$tag.log" 2>&1 &
  CPP_PID=$!
  log "llama-server ($tag, -np $np, -t $threads) pid $CPP_PID at $CPP_URL"
  wait_ready "$CPP_URL" /health "$CPP_PID" llama-server
}

STATUS=0
RUNS=()
# bench run concurrency [prefix...]: one `lmiserve bench` of both servers into $OUT/<run>/
bench() {
  local run=$1 c=$2; shift 2
  mkdir -p "$OUT/$run"
  log "bench $run: concurrency $c, $TOKENS forced tokens"
  { date -u; uptime; } >"$OUT/$run/load.txt"
  "$@" "$LMISERVE" bench --url "$LMI_URL" --compare-url "$CPP_URL" --compare-name llama-server \
    --concurrency "$c" --max-new-tokens "$TOKENS" --skip-baselines --device cpu --dtype int4 \
    --output-dir "$OUT/$run" "${BENCH_ARGS[@]}" 2>&1 | tee "$OUT/$run/bench.txt" || STATUS=1
  uptime >>"$OUT/$run/load.txt"
  RUNS+=("$run")
}

# make_cgroup: a child cgroup with a 1-CPU quota in $CGROUP (its cgroup.procs takes the servers), or
# nothing where this process may not make one
make_cgroup() {
  local name=lmiserve-bench-$$ base d
  if [[ -f /sys/fs/cgroup/cgroup.controllers ]]; then  # cgroup v2 only
    base=/sys/fs/cgroup$(sed -n 's/^0:://p' /proc/self/cgroup)
    d=$base/$name
    if mkdir "$d" 2>/dev/null; then
      if [[ -f "$d/cpu.max" ]] || echo +cpu >"$base/cgroup.subtree_control" 2>/dev/null; then
        if echo "100000 100000" >"$d/cpu.max" 2>/dev/null; then CGROUP=$d; return 0; fi
      fi
      rmdir "$d" 2>/dev/null || true
    fi
  elif [[ -d /sys/fs/cgroup/cpu && -f /sys/fs/cgroup/cpu/cpu.cfs_quota_us ]]; then  # cgroup v1 cpu controller
    d=/sys/fs/cgroup/cpu$(sed -n 's/^[0-9]*:\([^:]*,\)\?cpu\(,[^:]*\)\?:\(.*\)$/\3/p' /proc/self/cgroup | head -1)
    d=${d%/}/$name
    if mkdir "$d" 2>/dev/null; then
      if echo 100000 >"$d/cpu.cfs_period_us" 2>/dev/null && echo 100000 >"$d/cpu.cfs_quota_us" 2>/dev/null; then
        CGROUP=$d
        return 0
      fi
      rmdir "$d" 2>/dev/null || true
    fi
  fi
  return 1
}
# a prefix that moves the command into $CGROUP, then execs it (so that $! stays the server's pid)
in_cgroup() { IN_CGROUP=(sh -c 'echo $$ >"$0/cgroup.procs" && exec "$@"' "$CGROUP"); }

{
  date -u; uptime; lscpu | grep -E 'Model name|^CPU\(s\)'; grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' \
    | grep -E '^(avx|amx|fma|f16c)' | tr '\n' ' '; echo
  echo "llama-server: $LLAMA_SERVER ($LLAMA_VERSION)"; echo "lmiserve: $LMISERVE"; echo "GGUF: $GGUF"
  echo "MODE=$MODE LEVELS=$LEVELS TOKENS=$TOKENS THREADS=$THREADS bench args: ${BENCH_ARGS[*]}"
} >"$OUT/machine.txt"

case "$MODE" in
  levels)
    start_lmiserve all
    for c in $LEVELS; do
      start_llama "c$c" "$c" "$THREADS"
      bench "c$c" "$c"
      stop_pid "$CPP_PID"; CPP_PID=''
    done
    ;;
  busy)
    start_lmiserve c1
    start_llama c1 1 "$THREADS"
    bench c1-idle 1
    taskset -c "$BUSY_CORE" sh -c 'while :; do :; done' &
    BUSY_PID=$!
    log "busy loop on core $BUSY_CORE: pid $BUSY_PID"
    bench c1-busy 1
    stop_pid "$BUSY_PID"; BUSY_PID=''
    ;;
  cpu1)
    start_lmiserve core0 env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 NUMBA_NUM_THREADS=1 taskset -c 0
    start_llama core0 1 1 taskset -c 0
    bench c1-core0 1 taskset -c 1
    stop_pid "$CPP_PID"; CPP_PID=''; stop_pid "$LMI_PID"; LMI_PID=''
    if make_cgroup; then
      log "cgroup with a 1-CPU quota: $CGROUP (servers unpinned, llama-server -t $CG_THREADS)"
      lmi_env=(env)
      [[ "$CG_THREADS" == 1 ]] && lmi_env=(env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 NUMBA_NUM_THREADS=1)
      in_cgroup
      start_lmiserve cgroup "${IN_CGROUP[@]}" "${lmi_env[@]}"
      start_llama cgroup 1 "$CG_THREADS" "${IN_CGROUP[@]}"
      bench c1-cgroup 1
      stop_pid "$CPP_PID"; CPP_PID=''; stop_pid "$LMI_PID"; LMI_PID=''
      grep -E 'nr_throttled|throttled_(time|usec)' "$CGROUP"/cpu.stat >"$OUT/c1-cgroup/cpu.stat" 2>/dev/null || true
    else
      log "no cgroup with a CPU quota can be made here: run the container case with \`docker run --cpus 1\`"
      echo "cgroup run: not possible here (no writable cgroup cpu controller); use docker run --cpus 1" \
        >>"$OUT/machine.txt"
    fi
    ;;
  *) log "unknown MODE=$MODE (levels, busy, cpu1, build)"; exit 2 ;;
esac
{ date -u; uptime; } >>"$OUT/machine.txt"

# ---------------------------------------------------------------------------------------------------
# summary: tok/s per server per run, lmiserve / llama-server, and each run over the mode's first run

"$PY" - "$OUT" "$MODE" "${RUNS[@]}" <<'EOF' | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path

out, mode, runs = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
rows = []
for run in runs:
    try:
        report = json.loads((out / run / "bench.json").read_text())
    except (OSError, ValueError):
        rows.append({"run": run, "missing": True})
        continue
    by_kind = {s["kind"]: s for s in report["servers"]}
    for level in by_kind.get("lmi", {}).get("levels", []):
        c = level["concurrency"]
        peer = next((lv for lv in by_kind.get("openai", {}).get("levels", []) if lv["concurrency"] == c), {})
        rows.append({
            "run": run, "concurrency": c,
            "lmiserve_tok_s": level["output_tokens_per_s"], "llama_server_tok_s": peer.get("output_tokens_per_s"),
            "lmiserve_failed": level["failed_requests"] + level["token_count_errors"],
            "llama_server_failed": peer.get("failed_requests", 0) + peer.get("token_count_errors", 0),
            "lmiserve_itl_p50_ms": level["itl_ms"]["p50"], "llama_server_itl_p50_ms": (peer.get("itl_ms") or {}).get("p50"),
        })

def ratio(a, b):
    return round(a / b, 3) if a and b else None

for r in rows:
    if not r.get("missing"):
        r["lmiserve_over_llama_server"] = ratio(r["lmiserve_tok_s"], r["llama_server_tok_s"])
first = next((r for r in rows if not r.get("missing")), None)
if mode in ("busy", "cpu1") and first:
    for r in rows:
        if not r.get("missing"):
            r["lmiserve_vs_first"] = ratio(r["lmiserve_tok_s"], first["lmiserve_tok_s"])
            r["llama_server_vs_first"] = ratio(r["llama_server_tok_s"], first["llama_server_tok_s"])

head = f"{'run':<10} {'conc':>4} {'lmiserve tok/s':>14} {'llama-server tok/s':>18} {'lmi/llama':>9} {'failed':>7}"
if mode in ("busy", "cpu1"):
    head += f" {'lmi vs ' + runs[0]:>16} {'llama vs ' + runs[0]:>18}"
print(f"\nsummary ({mode}; output tokens/s of each server, forced tokens, ITL p50 in bench.json)")
print(head)
print("-" * len(head))
for r in rows:
    if r.get("missing"):
        print(f"{r['run']:<10} (no bench.json)")
        continue
    line = (f"{r['run']:<10} {r['concurrency']:>4} {r['lmiserve_tok_s'] or '-':>14} {r['llama_server_tok_s'] or '-':>18} "
            f"{r['lmiserve_over_llama_server'] or '-':>9} {str(r['lmiserve_failed']) + '/' + str(r['llama_server_failed']):>7}")
    if mode in ("busy", "cpu1"):
        line += f" {r['lmiserve_vs_first'] or '-':>16} {r['llama_server_vs_first'] or '-':>18}"
    print(line)
(out / "summary.json").write_text(json.dumps({"mode": mode, "rows": rows}, indent=2) + "\n")
EOF
exit "$STATUS"
