#!/bin/bash
cd /work/main
M=/root/.cache/lmiserve/gguf/SmolLM2-135M-Instruct.Q4_1-98362432-10aa646aae61
R=benchmarks/results/issue39-lean-kv-2026-12-07
lscpu | grep "Model name" > $R/lscpu.txt
for run in 1 2; do
for kv in auto bfloat16 fp8_e4m3; do
  for tree in before after; do
    if [ $tree = before ]; then export PYTHONPATH=/tmp/before; S=/tmp/before/benchmarks/decode_paths.py; else export PYTHONPATH=/work/main; S=benchmarks/decode_paths.py; fi
    echo "== run $run kv=$kv tree=$tree $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
    .venv/bin/python $S --model-id $M --device cpu --paths eager --concurrency 1,4 --max-new-tokens 64 \
      -o dtype=int4 -o kv_cache_dtype=$kv -o autotune_cache=/tmp/at-$tree.json --json $R/int4-$kv-$tree-run$run.json 2>&1 | grep -v WARNING | tail -6
  done
done
done
