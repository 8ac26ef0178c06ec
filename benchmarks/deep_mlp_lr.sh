#!/usr/bin/env bash
# deep-mlp's default learning rate: momentum SGD (0.9) at --lr 0.1 against 0.05 on digits
# (one process, hidden 128 and 1024; the default four allreduce workers; 3-stage pipelines:
# 1f1b, pipedream, pipedream-2bw) and mnist1d (one process), seeds 0-2 (0-1 for the longer
# ones), 300 steps or one epoch. One line per run: its flags and its final test accuracy,
# or "diverging" where the run stopped on a diverging loss. About 5 minutes on 2 cores.
#
#     bash benchmarks/deep_mlp_lr.sh > deep-mlp-lr.txt
export MPLCONFIGDIR=${MPLCONFIGDIR:-/tmp/plexus-mpl} PLEXUS_NO_REPORT=1
PY=${PY:-.venv/bin/python}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
run() {
  got=$($PY -m plexus.cli train --model deep-mlp "$@" --out "$OUT/run" --overwrite --quiet 2>&1 \
        | grep -o "final test accuracy [0-9.]*%\|diverging" | head -1)
  echo "$* -> ${got:-failed}"
}
for h in 128 1024; do for lr in 0.1 0.05 0.03; do for s in 0 1 2; do
  run --hidden $h --workers 1 --lr $lr --seed $s
done; done; done
for lr in 0.1 0.05; do for s in 0 1 2; do run --lr $lr --seed $s; done; done
for lr in 0.1 0.05; do for s in 0 1; do run --dataset mnist1d --workers 1 --lr $lr --seed $s; done; done
for lr in 0.1 0.05; do for s in 0 1; do
  run --stages 3 --microbatches 4 --lr $lr --seed $s --eval-every 0
  run --stages 3 --schedule pipedream --lr $lr --seed $s --eval-every 0
  run --stages 3 --schedule pipedream-2bw --microbatches 4 --lr $lr --seed $s --eval-every 0
done; done
