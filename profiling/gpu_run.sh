#!/usr/bin/env bash
# One device call on a GPU machine, from the repo root, writing into OUTDIR (at most 8 files):
#   bash profiling/gpu_run.sh results OUTDIR   benchmark sweep, check, demo, training runs
#   bash profiling/gpu_run.sh tests OUTDIR     the whole test suite on CUDA
#   bash profiling/gpu_run.sh ncu OUTDIR JOBS  Nsight Compute sections of ours and Inductor's kernels
#       (profiling/ncu_kernels.py over JOBS, pass:dtype:N,...): ncu.txt, ncu.csv
#   bash profiling/gpu_run.sh tune OUTDIR JOBS [VARIANT VARIANT_JOBS]...
#       profiling/tune.py --near (or $TUNE_FLAGS) over JOBS (pass:dtype:N,...), then for each VARIANT
#       (profiling/variants/apply.py) tune.py ${VARIANT_FLAGS:---near} over its jobs; then, if $TESTS is set, those
#       pytest arguments (time limit $TEST_TIMEOUT seconds, default 240).
set -u -o pipefail
what=$1; out=$2; shift 2
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# Wheels carried into .whl/ (the machine has no package index; profiling/results/README.md).
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
log="$out/log.txt"
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$log"
if [ "$what" = tests ]; then
  python3 -m pytest -q -rs -p no:cacheprovider tests 2>&1 | tee -a "$log"; echo "pytest rc=$?" | tee -a "$log"
  exit 0
fi
if [ "$what" = ncu ]; then
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  timeout "${NCU_TIMEOUT:-300}" "$NCU" --profile-from-start off --clock-control none --nvtx \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
    --section WarpStateStats -f -o /tmp/ncu python3 profiling/ncu_kernels.py --jobs "$1" 2>&1 | tail -5 | tee -a "$log"
  "$NCU" --import /tmp/ncu.ncu-rep > "$out/ncu.txt" 2>&1
  "$NCU" --import /tmp/ncu.ncu-rep --csv --page details > "$out/ncu.csv" 2>&1
  exit 0
fi
if [ "$what" = tune ]; then
  timeout "${TUNE_TIMEOUT:-200}" python3 profiling/tune.py ${TUNE_FLAGS:---near} --out "$out" --jobs "$1" --tag near 2>&1 | tee -a "$log"
  shift
  while [ $# -ge 2 ]; do
    python3 profiling/variants/apply.py "$1" | tee -a "$log"
    timeout 120 python3 profiling/tune.py ${VARIANT_FLAGS:---near} --out "$out" --jobs "$2" --tag "$1" 2>&1 | tee -a "$log"
    python3 profiling/variants/apply.py "$1" --revert
    shift 2
  done
  if [ -n "${TESTS:-}" ]; then
    eval "timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -rs -p no:cacheprovider $TESTS" 2>&1 \
      | tee "$out/pytest.txt" | tail -15 >> "$log"
  fi
  date -u | tee -a "$log"
  exit 0
fi
python3 -m torch_rmsnorm_op bench --out "$out" 2>&1 | tee -a "$log" | grep -v '^{'
python3 -m torch_rmsnorm_op check 2>&1 | tee -a "$log"; echo "check rc=$?" | tee -a "$log"
python3 -m torch_rmsnorm_op demo --logdir /tmp/runs 2>&1 | tee -a "$log"; echo "demo rc=$?" | tee -a "$log"
cp /tmp/runs/summary.md /tmp/runs/summary.png "$out"/
python3 -m torch_rmsnorm_op train-integration --out /tmp/integ 2>&1 | tee -a "$log"
python3 examples/train_tiny_gpt.py --steps 300 --out /tmp/gpt --logdir /tmp/runs/tiny_gpt 2>&1 | tail -2 | tee -a "$log"
cp /tmp/gpt/loss.png /tmp/gpt/loss.jsonl "$out"/
