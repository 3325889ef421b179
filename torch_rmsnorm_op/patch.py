"""The module patcher: swap a model's RMSNorms for ``torch.ops.rmsnorm``, in place, and back.

What is swapped:
- ``torch.nn.RMSNorm`` (any ``normalized_shape``, with or without weight);
- Hugging Face RMSNorms with Llama semantics (normalize in fp32, cast back to
  the input dtype, multiply by ``weight``; attributes ``weight`` and
  ``variance_epsilon``), recognized by what transformers itself declares
  (``kernel_layer_name == "RMSNorm"``, transformers >= 4.52) or, for older
  releases, by a short list of class names. Never by the class name alone:
  every candidate is proven on a probe input (its own forward against ours)
  before the swap, so a lookalike with other semantics (Gemma's
  ``(1 + weight)``) is skipped with the reason, never silently changed.

The replacement keeps the very same ``Parameter`` object (optimizers and
checkpoints stay valid; ``state_dict`` keys do not change) and remembers the
original module, which ``unpatch_rmsnorm`` puts back. Only the model passed
in changes; nothing happens at import time. Modules nested in wrappers (PEFT's
``ModulesToSaveWrapper`` holds copies as ordinary submodules) are found like
any other submodule.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from torch_rmsnorm_op import fusion
from torch_rmsnorm_op.fallback import fallback_policy
from torch_rmsnorm_op.functional import rms_norm
from torch_rmsnorm_op.module import RMSNorm

# transformers marks its RMSNorms (kernel_layer_name) only where the optional `kernels`
# package is installed, and not at all before 4.52. These classes have Llama's forward,
# verified on transformers 5.24 (forward source identical to LlamaRMSNorm's); each one is
# still proven on a probe before the swap.
KNOWN_LLAMA_STYLE = frozenset({
    "LlamaRMSNorm", "MistralRMSNorm", "MixtralRMSNorm", "MinistralRMSNorm", "Mistral3RMSNorm",
    "Qwen2RMSNorm", "Qwen2MoeRMSNorm", "Qwen2VLRMSNorm", "Qwen2_5_VLRMSNorm", "Qwen3RMSNorm", "Qwen3MoeRMSNorm",
    "Phi3RMSNorm", "GraniteRMSNorm", "GraniteMoeRMSNorm", "OlmoeRMSNorm", "DeepseekV2RMSNorm", "DeepseekV3RMSNorm",
    "GlmRMSNorm", "Glm4RMSNorm", "SmolLM3RMSNorm", "MllamaTextRMSNorm", "JambaRMSNorm", "ZambaRMSNorm",
})

# Probe tolerances: ours rounds once, Llama's forward rounds twice (cast, then * weight).
_PROBE_TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


class PatchedRMSNorm(nn.Module):
    """An RMSNorm served by ``torch.ops.rmsnorm``, standing in for ``original``.

    ``weight`` is the original's own Parameter (or None). ``output_dtype_from_weight``
    reproduces Llama's dtype rule: the output has ``promote_types(weight, input)``.
    """

    def __init__(self, original: nn.Module, normalized_shape: tuple[int, ...], eps: float | None,
                 weight: nn.Parameter | None, output_dtype_from_weight: bool) -> None:
        super().__init__()
        self.normalized_shape = normalized_shape
        self.eps = eps
        self.weight = weight
        self.output_dtype_from_weight = output_dtype_from_weight
        object.__setattr__(self, "_original", original)  # not a submodule: no duplicate state_dict keys

    @property
    def original(self) -> nn.Module:
        return self._original

    def forward(self, x: Tensor) -> Tensor:
        y = rms_norm(x, self.normalized_shape, self.weight, self.eps)
        if self.output_dtype_from_weight and self.weight is not None:
            y = y.to(torch.promote_types(self.weight.dtype, x.dtype))
        return y

    def extra_repr(self) -> str:
        return f"{tuple(self.normalized_shape)}, eps={self.eps}, replaces={type(self._original).__name__}"


@dataclass
class PatchReport:
    """What ``patch_rmsnorm`` did: ``swapped`` as (name, class), ``skipped`` as (name, class, reason)."""

    swapped: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"patched {len(self.swapped)} RMSNorm module(s), skipped {len(self.skipped)}"]
        lines += [f"  swapped {name or '<root>'} ({cls})" for name, cls in self.swapped]
        lines += [f"  skipped {name or '<root>'} ({cls}): {why}" for name, cls, why in self.skipped]
        return "\n".join(lines)


def _is_llama_style(module: nn.Module) -> bool:
    cls = type(module)
    declared = getattr(cls, "kernel_layer_name", None) == "RMSNorm" or cls.__name__ in KNOWN_LLAMA_STYLE
    return declared and hasattr(module, "variance_epsilon")


def _candidate(module: nn.Module) -> tuple[PatchedRMSNorm | None, str | None]:
    """The replacement for ``module``, or None with the reason it is not a candidate."""
    if isinstance(module, RMSNorm):
        return None, "already a torch_rmsnorm_op.RMSNorm"
    if isinstance(module, nn.RMSNorm):
        return PatchedRMSNorm(module, tuple(module.normalized_shape), module.eps, module.weight, False), None
    if _is_llama_style(module):
        weight = getattr(module, "weight", None)
        if not isinstance(weight, nn.Parameter) or weight.dim() != 1:
            return None, "Llama-style RMSNorm without a 1-D weight Parameter"
        eps = float(module.variance_epsilon)
        return PatchedRMSNorm(module, (weight.shape[0],), eps, weight, True), None
    if type(module).__name__.endswith("RMSNorm"):
        return None, ("not recognized: neither marked kernel_layer_name='RMSNorm' by transformers nor a known "
                      "Llama-style class (with weight and variance_epsilon); semantics unverified, left alone")
    return None, None  # not an RMSNorm at all: not reported


def _probe(original: nn.Module, patched: PatchedRMSNorm) -> str | None:
    """Run both forwards on a probe input; None if they agree, else why not."""
    weight = patched.weight
    device = weight.device if weight is not None else torch.device("cpu")
    dtype = weight.dtype if weight is not None and weight.dtype in _PROBE_TOL else torch.float32
    if device.type == "meta":
        return "parameters on the meta device: nothing to probe"
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((3, *patched.normalized_shape), generator=gen).to(device=device, dtype=dtype)
    try:
        with torch.no_grad(), fallback_policy("reference"):
            want, got = original(x), patched(x)
    except Exception as e:  # a forward that cannot run the probe is not proven
        return f"probe failed: {type(e).__name__}: {e}"
    if want.shape != got.shape or want.dtype != got.dtype:
        return (f"probe output differs in shape/dtype ({tuple(want.shape)} {want.dtype} vs "
                f"{tuple(got.shape)} {got.dtype})")
    tol = _PROBE_TOL[dtype]
    err = (want.double() - got.double()).abs().max().item() if want.numel() else 0.0
    scale = want.double().abs().max().item() if want.numel() else 0.0
    if not err <= tol * max(1.0, scale):
        return f"probe output differs from ours (max abs error {err:.3g}): other semantics"
    return None


def _named_children_recursive(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, nn.Module]]:
    """(qualified name, parent, attribute, child) for every submodule, parents first."""
    for parent_name, parent in model.named_modules(remove_duplicate=False):
        for attr, child in parent.named_children():
            yield (f"{parent_name}.{attr}" if parent_name else attr), parent, attr, child


def patch_rmsnorm(model: nn.Module) -> PatchReport:
    """Swap, in place, every ``nn.RMSNorm`` and every Llama-style HF RMSNorm inside ``model``
    (not ``model`` itself) for a ``PatchedRMSNorm``. Patching twice changes nothing more."""
    report = PatchReport()
    if _candidate(model)[0] is not None:
        report.skipped.append(("", type(model).__name__, "the root module cannot be swapped in place: patch its "
                                                         "parent, or use torch_rmsnorm_op.RMSNorm"))
    replaced: dict[int, PatchedRMSNorm] = {}  # a module shared by two parents is swapped once
    for name, parent, attr, child in list(_named_children_recursive(model)):
        if isinstance(child, PatchedRMSNorm):
            report.skipped.append((name, type(child.original).__name__, "already patched"))
            continue
        if id(child) in replaced:
            setattr(parent, attr, replaced[id(child)])
            continue
        patched, why = _candidate(child)
        if patched is None:
            if why is not None:
                report.skipped.append((name, type(child).__name__, why))
            continue
        why = _probe(child, patched)
        if why is not None:
            report.skipped.append((name, type(child).__name__, why))
            continue
        patched.train(child.training)
        setattr(parent, attr, patched)
        replaced[id(child)] = patched
        report.swapped.append((name, type(child).__name__))
    if report.swapped:
        # Compiled with Inductor, a residual add before a swapped norm fuses into it (fusion.py).
        fusion.install()
    return report


def unpatch_rmsnorm(model: nn.Module) -> int:
    """Put every original module back where ``patch_rmsnorm`` swapped it; returns how many."""
    count = 0
    for _, parent, attr, child in list(_named_children_recursive(model)):
        if isinstance(child, PatchedRMSNorm):
            setattr(parent, attr, child.original)
            count += 1
    return count


@contextlib.contextmanager
def patched_rmsnorm(model: nn.Module) -> Iterator[PatchReport]:
    """``with patched_rmsnorm(model) as report:`` patch for the block, then unpatch."""
    report = patch_rmsnorm(model)
    try:
        yield report
    finally:
        unpatch_rmsnorm(model)
