"""A tiny GPT trained on our RMSNorm under torch.compile, with checkpoints on SIGTERM / SIGUSR1.

    python examples/train_tiny_gpt.py --steps 200 --out outputs/gpt            # train
    kill -TERM <pid>                                                           # save and exit
    python examples/train_tiny_gpt.py --steps 200 --out outputs/gpt --resume   # continue, bit-exact
    kill -USR1 <pid>                                                           # save and continue

Writes OUT/loss.jsonl (one {"step", "loss"} line per optimizer step), OUT/loss.png and
TensorBoard scalars under --logdir (default runs/tiny_gpt).
"""

import argparse
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first kernel launch
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch_rmsnorm_op.tools.training import train_tiny_gpt  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, required=True, help="total optimizer steps")
    p.add_argument("--out", required=True, help="folder for loss.jsonl, loss.png and checkpoint.pt")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (default: inductor)")
    p.add_argument("--logdir", default="runs/tiny_gpt", help="TensorBoard scalars ('' for none)")
    args = p.parse_args()
    losses = train_tiny_gpt(args.steps, args.out, resume=args.resume, backend=args.backend,
                            logdir=args.logdir or None)
    print(f"ran {len(losses)} steps; last loss {losses[-1]:.4f}" if losses else "nothing to do")


if __name__ == "__main__":
    main()
