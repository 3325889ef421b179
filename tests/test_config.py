"""The launch table: every N the kernels serve gets a configuration that covers the row."""

import pytest
import torch

from torch_rmsnorm_op.config import MAX_N, MAX_SPLIT, backward_config, forward_config


def _lengths():
    for p in range(21):
        for n in (2**p - 1, 2**p, 2**p + 1):
            if 1 <= n <= MAX_N:
                yield n
    yield from (257, 5000, 20000, 300000)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_every_row_length_is_covered(dtype):
    for n in _lengths():
        for cfg in (forward_config(n, dtype), backward_config(n, dtype)):
            assert 1 <= cfg.split <= MAX_SPLIT, (n, cfg)
            # Split mode: its programs cover the row (a power of two of them, some may be
            # empty); a looped program steps over any row; otherwise one block holds a whole row.
            if cfg.split > 1:
                assert cfg.block_n * cfg.split >= n > cfg.block_n * cfg.split // 2, (n, cfg)
            elif not cfg.looped:
                assert cfg.block_n >= n, (n, cfg)
            assert cfg.num_warps * 32 <= cfg.block_n * cfg.rows or cfg.block_n * cfg.rows < 128, (n, cfg)
