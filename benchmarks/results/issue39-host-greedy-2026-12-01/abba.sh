#!/bin/bash
# ABBA rounds of step_host_cost at 128 rows: base worktree (A) and main (B)
# A: a worktree of the commit before (git worktree add /tmp/base 970c7b6; copy this step_host_cost.py there for
# --graph-pick), B: this checkout
out=$1; rounds=${2:-2}; mkdir -p $out
for r in $(seq 1 $rounds); do
  for side in A B B A; do
    dir=/tmp/base; [ $side = B ] && dir=/work/main
    n=$(ls $out | grep -c "^$side-")
    (cd $dir && /work/main/.venv/bin/python benchmarks/step_host_cost.py --rows 128 --paths fast --steps 200 $EXTRA --out $out/$side-$n > /dev/null 2>&1)
  done
done
