import sys

from torch_rmsnorm_op.cli import main

sys.exit(main())
