"""Benchmark script: ``python profiling/bench.py [--out DIR] [--quick] [--smoke]``.

The same as ``python -m torch_rmsnorm_op bench``; see ``torch_rmsnorm_op/tools/benchmark.py``
for what every number includes.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":
    from torch_rmsnorm_op.cli import main

    sys.exit(main(["bench", *sys.argv[1:]]))
