#!/usr/bin/env bash
# One lease of a GPU machine (16 cores, one GPU here), in one call:
#   - on cores 8-15: the CUDA path, `make demo`'s job with --device auto, then
#     tests/test_cuda.py (each strategy on the GPU against the CPU; pipelines against one
#     process), which CI, without a GPU, skips;
#   - on cores 0-7, meanwhile: the pipeline bubble at K = 2, 3 with a core for every stage
#     (benchmarks/pipeline_bubble.py), then `plexus bench pipeline` beside
#     torch.distributed.pipelining.
# Six files land in $OUT (or /tmp/device-check): machine.txt, demo.log, cuda.log,
# bubble.md, bubble.log, bench-pipeline.md. About 5 minutes on the H200 machine.
#
#     OUT=/tmp/x bash benchmarks/device_check.sh
set -u
OUT=${OUT:-/tmp/device-check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MPLCONFIGDIR=/tmp/plexus-mpl PLEXUS_NO_REPORT=1
PY=${PY:-python3}
# Two halves of the cores where there are 16 or more, so the bubble is measured beside nothing.
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
cuda_path &
cuda_pid=$!

pin 0-7 timeout 240 $PY benchmarks/pipeline_bubble.py --schedules gpipe,1f1b,zb-h1,interleaved \
  > "$OUT/bubble.md" 2> "$OUT/bubble.log"
echo "bubble exit $?" >> "$OUT/bubble.log"
pin 0-7 timeout 240 $PY -m plexus.cli bench pipeline --stages 2,3 --microbatches 4,8 --schedules gpipe,1f1b \
  --repeats 2 > "$OUT/bench-pipeline.md" 2>&1
echo "bench exit $?" >> "$OUT/bench-pipeline.md"
wait "$cuda_pid"
cat "$OUT/machine.txt" "$OUT/bubble.md"
tail -3 "$OUT/demo.log"
grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/cuda.log"
tail -15 "$OUT/bench-pipeline.md"
