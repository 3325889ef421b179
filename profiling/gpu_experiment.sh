#!/usr/bin/env bash
# One device call for a tuning experiment, from the repo root, writing into OUTDIR:
#   bash profiling/gpu_experiment.sh OUTDIR "PYTEST ARGS" JOBS [VARIANT_JOBS]
# runs the named tests, `check`, profiling/tune.py --near over JOBS (pass:dtype:N,...), then,
# if VARIANT_JOBS is given, the same over VARIANT_JOBS with profiling/variants/atomic_spin.py applied.
set -u -o pipefail
out=$1; tests=$2; jobs=$3; variant_jobs=${4:-}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
log="$out/log.txt"
{
  date -u; nvidia-smi --query-gpu=name,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$log"
if [ -n "$tests" ]; then
  # shellcheck disable=SC2086
  timeout 200 python3 -m pytest -q -rs -p no:cacheprovider $tests 2>&1 | tee "$out/pytest.txt" | tail -15 >> "$log"
fi
timeout 60 python3 -m torch_rmsnorm_op check 2>&1 | tail -4 | tee -a "$log"
timeout 230 python3 profiling/tune.py --near --out "$out" --jobs "$jobs" --tag near 2>&1 | tee -a "$log"
if [ -n "$variant_jobs" ]; then
  python3 profiling/variants/atomic_spin.py | tee -a "$log"
  timeout 90 python3 profiling/tune.py --near --out "$out" --jobs "$variant_jobs" --tag atomic_spin 2>&1 | tee -a "$log"
  python3 profiling/variants/atomic_spin.py --revert
fi
date -u | tee -a "$log"
