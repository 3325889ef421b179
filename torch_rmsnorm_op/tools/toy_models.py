"""Small models for examples, tests, the demo and the benchmarks (no downloads).

``LlamaStyleRMSNorm`` and ``GemmaStyleRMSNorm`` reproduce the forward code of
Hugging Face transformers' ``LlamaRMSNorm`` and ``GemmaRMSNorm`` (the second
computes ``(1 + weight)`` in fp32: the same attributes, other semantics).
``TinyLlama`` is a Llama-shaped decoder: embedding, blocks of attention and
MLP each behind an RMSNorm, a final RMSNorm and a tied output projection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class LlamaStyleRMSNorm(nn.Module):
    """transformers' LlamaRMSNorm: normalize in fp32, cast back, multiply by ``weight``."""

    kernel_layer_name = "RMSNorm"  # what transformers >= 4.52 sets through use_kernel_forward_from_hub

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: Tensor) -> Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class GemmaStyleRMSNorm(nn.Module):
    """transformers' GemmaRMSNorm: same attributes' shape, but ``(1 + weight)`` in fp32."""

    kernel_layer_name = "RMSNorm"

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        output = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, norm: type[nn.Module]) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = norm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = norm(dim)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.silu(self.up(self.mlp_norm(x))))


class TinyLlama(nn.Module):
    """A Llama-shaped decoder; ``norm`` picks the RMSNorm class (``nn.RMSNorm`` by default)."""

    def __init__(self, vocab: int = 256, dim: int = 64, depth: int = 2, heads: int = 4,
                 norm: type[nn.Module] = nn.RMSNorm) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, norm) for _ in range(depth))
        self.norm = norm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        nn.init.normal_(self.embed.weight, std=dim**-0.5)  # unit-scale logits at init, as GPTs do

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
