"""Checks and toy modules the tests share."""

import contextlib

import torch
from tolerances import SAME_OPS_FP32, few_roundings
from torch import nn

from torch_rmsnorm_op.patch import PatchedGatedRMSNorm
from torch_rmsnorm_op.tools.toy_models import LlamaStyleRMSNorm


def assert_computes_like(original, patched, x, gate=None) -> None:
    """``patched`` (swapped for ``original``) computes what ``original`` computes on ``x`` (and
    ``gate``, for a gated norm). Its output has the same dtype and lies within one unit in the
    last place: the kernels sum a row in another order. The semantics it was given, computed by
    the PyTorch reference, agrees on all but a few elements: an extra or missing rounding would
    move about a quarter of the bf16 ones."""
    inputs = (x,) if gate is None else (x, gate)
    want, got = original(*inputs), patched(*inputs)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **few_roundings(want.dtype))
    shape, weight, eps = patched.stand_in.arguments(patched, x)  # what the patched module's call took
    if isinstance(patched, PatchedGatedRMSNorm):
        ref = patched.semantics.reference(x, gate, weight, eps)
    else:
        ref = patched.semantics.reference(x, shape, weight, eps)
    assert ref.dtype == want.dtype
    if want.dtype == torch.float32:
        torch.testing.assert_close(ref, want, **SAME_OPS_FP32)
    else:
        torch.testing.assert_close(ref, want, **few_roundings(want.dtype))
        assert (ref != want).float().mean().item() <= 0.05


@contextlib.contextmanager
def compiling_afresh():
    """Compile as a new process would with empty caches: Dynamo reset, and neither
    AOTAutograd's nor Inductor's graph cache consulted. A cached graph keeps the decisions taken
    when it was traced (the kernels or the reference); a test of the decision itself must trace."""
    torch._dynamo.reset()
    with torch._functorch.config.patch(enable_autograd_cache=False), \
            torch._inductor.config.patch(fx_graph_cache=False):
        yield


def tiny_llama(norm_weights: tuple[float, float]):
    """A one-layer transformers Llama (hidden 32, 4 heads, 2 kv heads, vocabulary 128), seeded,
    its RMSNorm weights drawn from U(*norm_weights) so the weight's multiply is exercised."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      head_dim=8)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__.endswith("RMSNorm"):
                m.weight.uniform_(*norm_weights)
    return model


def run_once(tmp_path_factory, name: str, produce):
    """``produce(folder)``'s result (JSON), computed once per test run and shared by every test and
    worker process that asks for ``name``: the first caller runs it in a folder of its own while
    the others wait on a file lock, then read what it wrote. A failed run records nothing, so
    each caller that asks again runs it again and fails on its own."""
    import json
    import os

    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the folder the workers of this run share
    folder, done = root / f"once-{name}", root / f"once-{name}.json"
    with FileLock(str(root / f"once-{name}.lock")):
        if not done.exists():
            folder.mkdir(exist_ok=True)
            done.write_text(json.dumps(produce(folder)))
    return folder, json.loads(done.read_text())


class WeightlessRMSNorm(nn.Module):
    """No weight: normalizes whatever last dim it is given."""

    def __init__(self, eps=1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


class NormThenGateRMSNorm(LlamaStyleRMSNorm):
    """Qwen3-Next's, Qwen 3.5's, OLMo-Hybrid's gated norm: Llama's norm, then silu(gate) in fp32,
    cast back."""

    def forward(self, hidden_states, gate):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        hidden_states = self.weight * hidden_states.to(input_dtype)
        return (hidden_states * nn.functional.silu(gate.to(torch.float32))).to(input_dtype)
