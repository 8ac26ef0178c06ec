#!/usr/bin/env bash
# One lease of a GPU machine (16 cores, one GPU here), in one call, one part after another
# (cores 0-7 and 8-15 share the memory bus and the last-level cache, so nothing runs beside
# a measurement):
#   - the CUDA path: `make demo`'s job with --device auto, then tests/test_cuda.py (each
#     strategy on the GPU against the CPU; pipelines against one process), which CI,
#     without a GPU, skips;
#   - the pipeline bubble with a core for every stage (benchmarks/pipeline_bubble.py over
#     STAGES, default 2,3, the median of REPEAT runs a row, default 3), pinned to cores 0-7;
#     zb-h1 again with --spin off, and the ops padded to 2 ms (--op-ms) both ways;
#   - what one hand-off (a send, a receive) costs there (benchmarks/hand_off.py);
#   - with BENCH=1: `plexus bench pipeline` beside torch.distributed.pipelining, pinned too.
# Files land in $OUT (or /tmp/device-check): machine.txt, demo.log, cuda.log, bubble.md,
# spin-off.md, padded.md, bubble.log, hand-off.md and, with BENCH=1, bench-pipeline.md. On
# the H200 machine (2026-11-26) the CUDA path took about 1.5 minutes, STAGES=3 under 3 and
# STAGES=2 about 4 (each run of a row starts its processes afresh), the bench about 4; the
# spin-off and padded rows add about 2: keep one call under its 10 minutes (the whole script
# at STAGES=3 took 8.4 minutes there on 2026-11-28, the lease's start another half minute).
#
#     OUT=/tmp/x bash benchmarks/device_check.sh
set -u
OUT=${OUT:-/tmp/device-check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MPLCONFIGDIR=/tmp/plexus-mpl PLEXUS_NO_REPORT=1
PY=${PY:-python3}
# Cores 0-7 for what measures time where there are 16 or more.
pin() { if [ "$(nproc)" -ge 16 ] && command -v taskset > /dev/null; then taskset -c "$@"; else shift; "$@"; fi; }

{ nproc; nvidia-smi -L; $PY -c "import torch, sys; print(sys.version.split()[0], torch.__version__,
torch.cuda.is_available(), torch.cuda.device_count(), torch.distributed.is_nccl_available())"; } > "$OUT/machine.txt" 2>&1

cuda_path() {
  pin 8-15 timeout 120 $PY -m plexus.cli train --strategy allreduce --algorithm ring --workers 4 --dataset digits \
    --model mlp --steps 300 --out /tmp/device-demo --overwrite --quiet > "$OUT/demo.log" 2>&1
  echo "demo exit $?" >> "$OUT/demo.log"
  pin 8-15 timeout 240 $PY -m pytest -q -p no:cacheprovider -n 8 -rA tests/test_cuda.py > "$OUT/cuda.log" 2>&1
  echo "tests exit $?" >> "$OUT/cuda.log"
}
cuda_path

# Each row goes to bubble.log as it is measured, so a run cut short keeps what it measured.
pin 0-7 timeout 420 $PY benchmarks/pipeline_bubble.py --stages "${STAGES:-2,3}" \
  --schedules gpipe,1f1b,zb-h1,interleaved --repeat "${REPEAT:-3}" > "$OUT/bubble.md" 2> "$OUT/bubble.log"
echo "bubble exit $?" >> "$OUT/bubble.log"
# --spin auto polls there (8 cores for at most 4 stage processes): zb-h1 again with
# receives that sleep, for the difference (about a minute at STAGES=3); then every op padded
# to 2 ms on a 32-wide model, both ways: the executor's own gap on that machine (about one).
pin 0-7 timeout 150 $PY benchmarks/pipeline_bubble.py --stages "${STAGES:-2,3}" --schedules zb-h1 --spin off \
  --repeat "${REPEAT:-3}" > "$OUT/spin-off.md" 2>> "$OUT/bubble.log"
pin 0-7 timeout 120 $PY benchmarks/pipeline_bubble.py --stages "${STAGES:-2,3}" --schedules 1f1b,zb-h1 --hidden 32 \
  --op-ms 2,2,2 --spin off,on > "$OUT/padded.md" 2>> "$OUT/bubble.log"
# What one hand-off costs on this machine's cores, beside a Linear's products, and between
# two processes with receives that sleep or poll (about 40 s).
pin 0-1 timeout 90 $PY benchmarks/hand_off.py > "$OUT/hand-off.md" 2>&1
if [ "${BENCH:-0}" = 1 ]; then
  pin 0-7 timeout 300 $PY -m plexus.cli bench pipeline --stages "${STAGES:-2,3}" --microbatches 4,8 \
    --schedules gpipe,1f1b --repeats 2 > "$OUT/bench-pipeline.md" 2>&1
  echo "bench exit $?" >> "$OUT/bench-pipeline.md"
fi
cat "$OUT/machine.txt" "$OUT/bubble.md" "$OUT/spin-off.md" "$OUT/padded.md" "$OUT/hand-off.md"
tail -3 "$OUT/demo.log"
grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/cuda.log"
if [ -f "$OUT/bench-pipeline.md" ]; then tail -15 "$OUT/bench-pipeline.md"; fi
