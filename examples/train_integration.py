"""The tutorial's training integration: python examples/train_integration.py [--steps 100]

Same as ``python -m torch_rmsnorm_op train-integration``: Linear -> RMSNorm -> SiLU -> Linear,
reference path vs kernel path from one initialization, 100 Adam steps of 32, save and reload,
counters proving the kernel path ran, test MSE of both paths side by side.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":
    from torch_rmsnorm_op.cli import main

    sys.exit(main(["train-integration", *sys.argv[1:]]))
