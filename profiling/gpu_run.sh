#!/usr/bin/env bash
# One device call: environment, the whole test suite on CUDA, the check campaign, the benchmark.
# Usage (on a GPU machine, repo root): bash profiling/gpu_run.sh OUTDIR [--quick]
set -u -o pipefail
out=${1:-profiling/results/gpu}; shift || true
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$out/env.txt"
python3 -m pytest -q -rs -p no:cacheprovider tests 2>&1 | tee "$out/pytest.txt"; echo "pytest rc=$?" | tee -a "$out/pytest.txt"
python3 -m torch_rmsnorm_op check 2>&1 | tee "$out/check.txt"; echo "check rc=$?" | tee -a "$out/check.txt"
python3 profiling/bench.py --out "$out" "$@" 2>&1 | tee "$out/bench_log.txt"
