#!/bin/bash
set -x
R=/work/main/benchmarks/results/engine-process-prepare-2026-11-30
cd /tmp/before-tree && PYTHONPATH=/tmp/before-tree /work/main/.venv/bin/python benchmarks/engine_process.py --model-id /tmp/tiny4k/tiny --concurrency 32,128 --rounds 2 --probe --json $R/before-3ad48f9.json > $R/before.log 2>&1
cd /work/main && .venv/bin/python benchmarks/engine_process.py --model-id /tmp/tiny4k/tiny --concurrency 32,128 --rounds 2 --probe --json $R/after-c0f415d.json > $R/after.log 2>&1
cd /tmp/before-tree && PYTHONPATH=/tmp/before-tree /work/main/.venv/bin/python benchmarks/engine_process.py --model-id /tmp/tiny4k/tiny --concurrency 128 --rounds 2 --probe --json $R/before-3ad48f9-2.json > $R/before-2.log 2>&1
cd /work/main && .venv/bin/python benchmarks/engine_process.py --model-id /tmp/tiny4k/tiny --concurrency 128 --rounds 2 --probe --json $R/after-c0f415d-2.json > $R/after-2.log 2>&1
echo done > $R/.done
