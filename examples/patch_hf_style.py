"""Patch models whose RMSNorms are Hugging Face-style classes: recognized by what they compute.

A Llama-style norm (its own class name, found on no list) is swapped as ``llama``, a
Gemma-style ``(1 + weight)`` one as ``gemma``, a gated one (``forward(x, gate)``, Qwen3-Next's
order) as ``llama*silu(gate)``, and a lookalike that computes something else is left alone
with the measured difference. With transformers installed, a tiny Gemma 3, a tiny T5 encoder
and a tiny Mamba 2 (built from configs, nothing downloaded) are patched too.

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


class MyGatedRMSNorm(MyRMSNorm):
    """A linear-attention output norm: Llama's norm, then silu(gate) in fp32."""

    def forward(self, hidden_states, gate):
        input_dtype = hidden_states.dtype
        return (super().forward(hidden_states) * nn.functional.silu(gate.float())).to(input_dtype)


class GatedBlock(nn.Module):
    def __init__(self, hidden_size):
        super().__init__()
        self.proj = nn.Linear(hidden_size, 2 * hidden_size)
        self.norm = MyGatedRMSNorm(hidden_size)

    def forward(self, x):
        return self.norm(*self.proj(x).chunk(2, dim=-1))


class MyScaledRMSNorm(MyRMSNorm):
    """Looks like the others, computes twice Llama's result: no semantics of ours."""

    def forward(self, x):
        return 2 * super().forward(x)


def tiny_transformers_models():
    try:
        import transformers
    except ImportError:
        return []
    gemma3 = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8))
    t5 = transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4))
    mamba2 = transformers.Mamba2ForCausalLM(transformers.Mamba2Config(  # its mixer's gated norm in 2 groups
        vocab_size=128, hidden_size=32, num_hidden_layers=1, num_heads=8, head_dim=8, n_groups=2, state_size=16,
        chunk_size=8))
    return [("Gemma 3", gemma3), ("T5 encoder", t5), ("Mamba 2", mamba2)]


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = nn.Sequential(nn.Linear(32, 32), MyRMSNorm(32), nn.SiLU(), MyGemmaRMSNorm(32), GatedBlock(32),
                          MyScaledRMSNorm(32))
    model = model.to(device)
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
    print("unpatched again:", type(model[1]).__name__)

    tokens = torch.randint(0, 128, (2, 8), device=device)
    for name, hf_model in tiny_transformers_models():
        hf_model = hf_model.to(device).eval()
        with torch.no_grad():
            before = hf_model(tokens)[0]
            report = T.patch_rmsnorm(hf_model)
            after = hf_model(tokens)[0]
        print(f"\n{name}: {report.semantics_counts()}, {len(report.skipped)} skipped, "
              f"max |patched - original| {(after - before).abs().max().item():.2g}")


if __name__ == "__main__":
    main()
