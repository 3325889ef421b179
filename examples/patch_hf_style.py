"""Patch a model that defines its own Hugging Face-style RMSNorm (no transformers needed).

A Llama-style norm (weight + variance_epsilon, fp32 normalize, cast back, * weight) is
swapped; a Gemma-style lookalike ((1 + weight)) is proven different on a probe and left alone.

Run: python examples/patch_hf_style.py
"""

import os
import sys

import torch
from torch import nn

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch_rmsnorm_op as T  # noqa: E402


class MyRMSNorm(nn.Module):
    """Copied from a model repo: Llama semantics, its own class name."""

    kernel_layer_name = "RMSNorm"  # transformers >= 4.52 marks its RMSNorms like this

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class MyGemmaRMSNorm(MyRMSNorm):
    def forward(self, x):
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (out * (1.0 + self.weight.float())).type_as(x)


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = nn.Sequential(nn.Linear(32, 32), MyRMSNorm(32), nn.SiLU(), MyGemmaRMSNorm(32)).to(device)
    x = torch.randn(4, 32, device=device)
    with torch.no_grad():
        before = model(x)
    weight = model[1].weight
    with T.patched_rmsnorm(model) as report:
        print(report)
        assert model[1].weight is weight  # the same Parameter: optimizers and checkpoints stay valid
        with torch.no_grad():
            after = model(x)
        print("max |patched - original|:", (after - before).abs().max().item())
        print("dispatch:", T.dispatch_stats())
    print("unpatched again:", type(model[1]).__name__)


if __name__ == "__main__":
    main()
