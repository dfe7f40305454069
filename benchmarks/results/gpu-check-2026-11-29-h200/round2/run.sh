#!/usr/bin/env bash
# issue 39, the second device call of 2026-11-29: what the first left (fp8 on the 8B shape, kernels in graphs,
# the mended CUDA tests, 128 streams with stream_interval). Every step has a limit inside DEADLINE seconds.
set -u
START=$(date +%s); DEADLINE=${DEADLINE:-340}
O=${OUT:-/tmp/out}; W=/tmp/fu; mkdir -p "$W" "$O"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD:$PWD/.gpu/round2 PYTHONUNBUFFERED=1
left() { echo $(( DEADLINE - ($(date +%s) - START) )); }
step() {  # step NAME MAX_SECONDS CMD...
  local name=$1 max=$2; shift 2
  local t=$(left); [ "$max" -gt "$t" ] && max=$t
  if [ "$max" -lt 15 ]; then echo "== $name: skipped ($t s left)"; return; fi
  echo "== $name (at most $max s) $(date -u +%T)"
  timeout -s INT "$max" "$@" >"$W/$name.log" 2>&1; echo "== $name: exit $? after $(( $(date +%s) - START )) s"
  tail -n 25 "$W/$name.log"
}
python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import gpu_check; from pathlib import Path; [gpu_check.dummy_model_dir(s, Path('$W') / f'model-{s}') for s in ('1b', '8b')]"
step kernels 45 python3 benchmarks/quantized_kernels.py --out "$W/quantized-kernels" --rows 1,16,128 --iters 20
step ab-8b-fp8 175 python3 -m lmiserve bench --model-id "$W/model-8b" -o load_format=dummy --device cuda --dtype bf16 \
  --concurrency 1 --max-new-tokens 128 --requests-per-client 3 --skip-baselines --ab-option quantize=fp8 --output-dir "$W/ab-8b-fp8"
export LMISERVE_TEST_DEVICE=cuda PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
step tests 70 python3 -m pytest -q -p no:cacheprovider -p pytest_asyncio.plugin -p xdist.plugin -n 4 \
  tests/unit/test_kv_fp8.py tests/unit/test_profile_step.py tests/unit/test_draft_pool.py tests/unit/test_quantized_checkpoints.py \
  tests/unit/test_async_engine.py::test_sample_rows_exception_ends_only_that_sequence \
  tests/unit/test_fast_llama.py::test_a_step_with_newcomers_is_one_forward
step diag 30 python3 -m pytest -q -s -p no:cacheprovider -p pytest_asyncio.plugin -p diag_forward \
  tests/unit/test_fast_llama.py::test_a_step_with_newcomers_is_one_forward
unset LMISERVE_TEST_DEVICE PYTEST_DISABLE_PLUGIN_AUTOLOAD
step ab-1b-128-interval 120 python3 -m lmiserve bench --model-id "$W/model-1b" -o load_format=dummy -o max_rolling_batch_size=128 \
  --device cuda --dtype bf16 --concurrency 128 --max-new-tokens 128 --requests-per-client 2 --client-processes 4 \
  --skip-baselines --ab-option stream_interval=8 --output-dir "$W/ab-1b-128-interval"
rm -rf "$W"/model-*
tar czf "$O/round2.tgz" -C "$W" .
echo "done after $(( $(date +%s) - START )) s"
