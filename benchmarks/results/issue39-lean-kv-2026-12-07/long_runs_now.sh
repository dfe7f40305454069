#!/bin/bash
cd /work/main
M=/root/.cache/lmiserve/gguf/SmolLM2-135M-Instruct.Q4_1-98362432-10aa646aae61
R=benchmarks/results/issue39-lean-kv-2026-12-07
export PYTHONPATH=/work/main
for kv in auto fp8_e4m3 bfloat16; do
    echo "== now dtype=int4 kv=$kv $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
    .venv/bin/python benchmarks/decode_paths.py --model-id $M --device cpu --paths eager --concurrency 1,4 --max-new-tokens 128 --context 2000 \
      -o dtype=int4 -o kv_cache_dtype=$kv -o autotune_cache=/tmp/at-after.json --json $R/long-int4-$kv-now-run1.json 2>&1 | grep -E "Error|_per_s"
done
