#!/usr/bin/env bash
# One device call for a tuning experiment, from the repo root, writing into OUTDIR:
#   bash profiling/gpu_experiment.sh OUTDIR "PYTEST ARGS" JOBS [VARIANT JOBS]...
# runs profiling/tune.py --near over JOBS (pass:dtype:N,...), then for each VARIANT
# (profiling/variants/apply.py) the same over its JOBS, then the named tests (none if "";
# time limit $TEST_TIMEOUT seconds, default 240).
set -u -o pipefail
out=$1; tests=$2; jobs=$3; shift 3
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
log="$out/log.txt"
{
  date -u; nvidia-smi --query-gpu=name,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$log"
timeout 200 python3 profiling/tune.py --near --out "$out" --jobs "$jobs" --tag near 2>&1 | tee -a "$log"
while [ $# -ge 2 ]; do
  python3 profiling/variants/apply.py "$1" | tee -a "$log"
  timeout 120 python3 profiling/tune.py --near --out "$out" --jobs "$2" --tag "$1" 2>&1 | tee -a "$log"
  python3 profiling/variants/apply.py "$1" --revert
  shift 2
done
if [ -n "$tests" ]; then
  eval "timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -rs -p no:cacheprovider $tests" 2>&1 \
    | tee "$out/pytest.txt" | tail -15 >> "$log"
fi
date -u | tee -a "$log"
