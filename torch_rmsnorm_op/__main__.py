import os
import sys

import torch

# The kernels run on CPU tensors only through the Triton interpreter, which
# must be chosen before any kernel is defined: without CUDA, choose it here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from torch_rmsnorm_op.cli import main  # noqa: E402

sys.exit(main())
