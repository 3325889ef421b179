"""The module patcher: what it swaps and skips, identity of parameters, undo, wrappers;
the recognition rule and the probe on hand-written lookalikes."""

import copy
import re

import pytest
import torch
from checks import NormThenGateRMSNorm, WeightlessRMSNorm, assert_computes_like, compiling_afresh
from tolerances import MODEL, NORM_FP32, TOL, grad_tol
from torch import nn

import torch_rmsnorm_op as T
from torch_rmsnorm_op.patch import PatchedGatedRMSNorm
from torch_rmsnorm_op.recognize import CENTERED, GEMMA, INPUT_SCALED, LLAMA, T5, TORCH, recognize
from torch_rmsnorm_op.tools.toy_models import GemmaStyleRMSNorm, LlamaStyleRMSNorm, TinyLlama


class Qwen2RMSNorm(LlamaStyleRMSNorm):
    """No kernel_layer_name mark, a name on no list: recognized by what it computes."""

    kernel_layer_name = None


class LooksLikeLlamaButIsNot(LlamaStyleRMSNorm):
    """Declares Llama style but computes something else: the probe must catch it."""

    def forward(self, x):
        return super().forward(x) * 2


class Olmo2StyleRMSNorm(LlamaStyleRMSNorm):
    """OLMo2's order: multiply in fp32, round once (differs from Llama only in half precision)."""

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return (self.weight * hidden_states).to(input_dtype)


class TwoEpsRMSNorm(LlamaStyleRMSNorm):
    """Holds two epsilons and uses ``eps``, twice ``variance_epsilon``: a difference that only
    the probe's row at the epsilon's scale shows."""

    def __init__(self, hidden_size):
        super().__init__(hidden_size, eps=1e-6)
        self.eps = 2e-6

    def forward(self, x):
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class HardCodedEpsRMSNorm(LlamaStyleRMSNorm):
    """Says ``variance_epsilon=1e-6`` but adds 2e-6: no epsilon attribute holds what it uses."""

    def forward(self, x):
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 2e-6)).to(x.dtype)


class TrainOnlyScaleRMSNorm(LlamaStyleRMSNorm):
    def forward(self, x):
        return super().forward(x) * (1.5 if self.training else 1.0)


class GroupRMSNorm(LlamaStyleRMSNorm):
    """Normalizes groups of 4 features: a 1-D weight, but not one row per input row."""

    def forward(self, x):
        g = x.float().unflatten(-1, (-1, 4))
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * g.flatten(-2).to(x.dtype)


class MaybeGroupedRMSNorm(LlamaStyleRMSNorm):
    """Normalizes groups of ``group`` features when ``group`` is set, whole rows otherwise."""

    def __init__(self, hidden_size, group=None):
        super().__init__(hidden_size)
        self.group = group

    def forward(self, x):
        g = x.float().unflatten(-1, (-1, self.group or x.shape[-1]))
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * g.flatten(-2).to(x.dtype)


class StreamsRMSNorm(GemmaStyleRMSNorm):
    """Qwen4Exp's hyper-connection norms: the groups ``group_size`` names normalized apart (the
    whole row without one), scaled by their parts of Gemma's ``1 + weight``; or, ``llama``,
    rounded to x's dtype and then scaled by the weight."""

    def __init__(self, hidden_size, group_size=None, llama=False):
        super().__init__(hidden_size)
        self.group_size, self.llama = group_size, llama

    def forward(self, x):
        g = x.float().unflatten(-1, (-1, self.group_size or x.shape[-1]))
        n = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        if self.llama:
            return self.weight * n.to(x.dtype)
        return (n * (1.0 + self.weight.float())).type_as(x)


class CenteredRMSNorm(GemmaStyleRMSNorm):
    """MuseSpark's text norms: Gemma's, but ``1 + weight`` added in the weight's dtype."""

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight).float()).type_as(x)


class InputScaledRMSNorm(GemmaStyleRMSNorm):
    """MuseSpark's post-feedforward norms: x scaled by ``1 + weight`` and rounded, then normalized."""

    def forward(self, x):
        xs = (x.float() * (1.0 + self.weight).float()).type_as(x).float()
        return (xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


class T5StyleLayerNorm(LlamaStyleRMSNorm):
    """transformers' T5LayerNorm: an RMSNorm by another name, rounding to the weight's dtype."""

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight.dtype in [torch.float16, torch.bfloat16]:
            hidden_states = hidden_states.to(self.weight.dtype)
        return self.weight * hidden_states


class GatedRMSNorm(LlamaStyleRMSNorm):
    def forward(self, x, gate=None):
        return super().forward(x) * (1 if gate is None else torch.sigmoid(gate))


# The gated norms' forms (forward(hidden_states, gate)), as transformers writes them.
class Fp32SigmoidGateRMSNorm(LlamaStyleRMSNorm):
    """Kimi Linear's: scaled in fp32, then sigmoid(gate); ``gate=None`` in the signature only."""

    def forward(self, hidden_states, gate=None):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = self.weight.to(torch.float32) * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))
        return (hidden_states * torch.sigmoid(gate.to(torch.float32))).to(input_dtype)


class GateThenGroupNormRMSNorm(LlamaStyleRMSNorm):
    """Mamba 2's (Bamba's, Zamba2's, NemotronH's): x * silu(gate), normalized in groups, Llama's
    rounding, the output not cast back; no gate, no gating."""

    def __init__(self, hidden_size, group_size):
        super().__init__(hidden_size)
        self.group_size = group_size

    def forward(self, hidden_states, gate=None):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        if gate is not None:
            hidden_states = hidden_states * nn.functional.silu(gate.to(torch.float32))
        groups = hidden_states.view(*hidden_states.shape[:-1], -1, self.group_size)
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * groups.view(hidden_states.shape).to(input_dtype)


class FalconH1StyleGatedRMSNorm(LlamaStyleRMSNorm):
    """Falcon-H1's: groups, scaled in fp32, the gate before or after the norm, cast back."""

    def __init__(self, hidden_size, n_groups=1, norm_before_gate=True):
        super().__init__(hidden_size)
        self.n_groups, self.norm_before_gate = n_groups, norm_before_gate

    def forward(self, hidden_states, gate=None):
        input_dtype = hidden_states.dtype
        if not self.norm_before_gate and gate is not None:
            hidden_states = hidden_states * nn.functional.silu(gate.to(torch.float32))
        groups = hidden_states.to(torch.float32).unflatten(-1, (self.n_groups, -1))
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        hidden_states = (self.weight.view(self.n_groups, -1) * groups).flatten(-2)
        if self.norm_before_gate and gate is not None:
            hidden_states = hidden_states * nn.functional.silu(gate.to(torch.float32))
        return hidden_states.to(input_dtype)


class BiasRMSNorm(LlamaStyleRMSNorm):
    def __init__(self, hidden_size):
        super().__init__(hidden_size)
        self.bias = nn.Parameter(torch.zeros(hidden_size))


class CustomLayerNorm(nn.Module):
    """Another norm named like one (mean subtracted, a bias): not examined, not reported."""

    def __init__(self, dim):
        super().__init__()
        self.weight, self.bias, self.eps = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.zeros(dim)), 1e-5

    def forward(self, x):
        return nn.functional.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


class ModulesToSaveWrapper(nn.Module):
    """The shape of PEFT's wrapper: the original and per-adapter copies as submodules."""

    def __init__(self, module):
        super().__init__()
        self.original_module = module
        self.modules_to_save = nn.ModuleDict({"default": copy.deepcopy(module)})

    def forward(self, x):
        return self.modules_to_save["default"](x)


def _randomize(model):
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(0.5, 1.5)
    return model


def test_swaps_torch_and_llama_style_keeps_parameters(device):
    model = _randomize(TinyLlama(norm=LlamaStyleRMSNorm)).to(device)
    model.norm = _randomize(nn.RMSNorm(64, eps=1e-5)).to(device)
    params = {n: p for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    tokens = torch.randint(0, 256, (2, 8), device=device)
    with T.fallback_policy("reference"):
        want = model(tokens)
    optimizer = torch.optim.Adam(model.parameters())
    report = T.patch_rmsnorm(model)
    assert len(report.swapped) == 5 and not report.skipped, report
    assert {(cls, sem) for _, cls, sem in report.swapped} == {("LlamaStyleRMSNorm", "llama"), ("RMSNorm", "torch")}
    assert all(isinstance(m, T.PatchedRMSNorm) for m in (model.norm, model.blocks[0].attn_norm))
    assert {n: p for n, p in model.named_parameters()} == params  # the very same objects
    assert all(a is b for a, b in zip(model.parameters(), optimizer.param_groups[0]["params"]))
    assert list(model.state_dict()) == keys
    T.reset_dispatch_stats()
    got = model(tokens)
    assert T.dispatch_stats()["kernel"]["rmsnorm.fwd"] == 5
    torch.testing.assert_close(got, want, **MODEL[torch.float32])
    got.sum().backward()
    optimizer.step()  # the optimizer built before the patch updates the live parameters


def test_patching_counts_none_of_the_probes_calls(device):
    """The probes' calls of the kernels are the patcher's, not the user's: ``dispatch_stats``
    stays as it was (a weightless norm is probed on CPU, which on a CUDA machine without the
    interpreter is a fallback), and a fallback the user meets afterwards still warns first."""
    model = nn.Sequential(LlamaStyleRMSNorm(16), nn.RMSNorm(16), WeightlessRMSNorm(), Olmo2StyleRMSNorm(16)).to(device)
    T.reset_dispatch_stats()
    report = T.patch_rmsnorm(model)
    assert len(report.swapped) == 4, report
    assert T.dispatch_stats() == {"kernel": {}, "fallback": {}, "compiled": {}, "sites": {}}
    x = torch.randn(3, 16, device=device)
    with T.fallback_policy("error"):
        model(x)
    assert T.dispatch_stats()["kernel"] == {"rmsnorm.fwd": 4} and not T.dispatch_stats()["fallback"]
    with T.fallback_policy("warn"), pytest.warns(UserWarning, match="falls back"):
        model(x.double())


def test_the_replacement_carries_the_originals_plain_attributes():
    """Code that reads a norm's attributes off the module a model holds still finds them once
    it is swapped (Mamba 2's fused CUDA path passes ``norm.variance_epsilon`` to its kernel):
    numbers, strings and tuples are copied; the replacement's own ``eps`` is the epsilon the
    forward uses."""
    model = nn.ModuleList([nn.RMSNorm(16, elementwise_affine=True), GateThenGroupNormRMSNorm(16, 4),
                           TwoEpsRMSNorm(16)])
    originals = list(model)
    T.patch_rmsnorm(model)
    assert model[0].elementwise_affine is True and model[0].normalized_shape == (16,)
    assert (model[1].variance_epsilon, model[1].group_size) == (originals[1].variance_epsilon, 4)
    assert (model[2].eps, model[2].variance_epsilon) == (2e-6, 1e-6)
    assert list(model.state_dict()) == ["0.weight", "1.weight", "2.weight"]


def test_a_module_held_in_several_places_is_swapped_and_restored_at_each(device):
    """A norm under two attributes of one parent (which ``named_children`` lists once) and a
    block shared by several parents: every attribute gets the one patched module, the report
    lists it once, and ``unpatch_rmsnorm`` puts the original back everywhere, counting it once."""
    norm = nn.RMSNorm(8).to(device)
    block = nn.Sequential(nn.Linear(8, 8), nn.RMSNorm(8)).to(device)
    model = nn.ModuleDict(dict(a=norm, b=norm, c=block, d=nn.Sequential(block)))
    report = T.patch_rmsnorm(model)
    assert [name for name, *_ in report.swapped] == ["a", "c.1"] and not report.skipped, report
    assert isinstance(model["a"], T.PatchedRMSNorm) and model["b"] is model["a"]
    assert isinstance(block[1], T.PatchedRMSNorm) and model["d"][0] is block
    x = torch.randn(3, 8, device=device)
    with T.fallback_policy("reference"):
        torch.testing.assert_close(model["b"](x), torch.nn.functional.rms_norm(x, (8,), norm.weight, norm.eps))
    assert T.unpatch_rmsnorm(model) == 2
    assert model["a"] is norm and model["b"] is norm and isinstance(block[1], nn.RMSNorm)
    assert not any(isinstance(m, T.PatchedRMSNorm) for _, m in model.named_modules(remove_duplicate=False))


def test_semantics_by_probe_and_lookalikes_skipped_with_reasons(device):
    model = nn.Sequential(GemmaStyleRMSNorm(16), LooksLikeLlamaButIsNot(16), Qwen2RMSNorm(16), nn.LayerNorm(16),
                          Olmo2StyleRMSNorm(16), T5StyleLayerNorm(16), CustomLayerNorm(16),
                          CenteredRMSNorm(16), InputScaledRMSNorm(16)).to(device)
    report = T.patch_rmsnorm(model)
    assert report.swapped == [("0", "GemmaStyleRMSNorm", "gemma"), ("2", "Qwen2RMSNorm", "llama"),
                              ("4", "Olmo2StyleRMSNorm", "torch"), ("5", "T5StyleLayerNorm", "t5"),
                              ("7", "CenteredRMSNorm", "centered"), ("8", "InputScaledRMSNorm", "input_scaled")], report
    assert [(name, cls) for name, cls, _ in report.skipped] == [("1", "LooksLikeLlamaButIsNot")]
    assert "computes none of torch, llama, gemma, t5, centered, input_scaled" in report.skipped[0].reason
    assert isinstance(model[1], LooksLikeLlamaButIsNot) and isinstance(model[3], nn.LayerNorm)
    assert isinstance(model[6], CustomLayerNorm)
    text = str(report)
    assert "left alone 1 (LooksLikeLlamaButIsNot)" in text and "swapped 0 (GemmaStyleRMSNorm)" in text
    assert report.semantics_counts() == {"gemma": 1, "llama": 1, "torch": 1, "t5": 1, "centered": 1, "input_scaled": 1}


def test_the_report_says_what_its_words_mean():
    """The report names each swapped module's semantics with what it computes (and the symbols
    that says it in), and each difference that left a lookalike alone in the units it is
    counted in."""
    model = nn.Sequential(nn.RMSNorm(16), LlamaStyleRMSNorm(16), StreamsRMSNorm(16, group_size=4),
                          NormThenGateRMSNorm(16), LooksLikeLlamaButIsNot(16))
    report = T.patch_rmsnorm(model)
    lines = str(report).splitlines()
    assert lines[0] == "4 RMSNorm module(s) swapped for torch.ops.rmsnorm, 1 examined and left alone"
    assert lines[1:5] == [
        "  swapped 0 (RMSNorm), which computes 'torch': (n * w).to(x.dtype): normalize and scale in fp32, round once",
        "  swapped 1 (LlamaStyleRMSNorm), which computes 'llama': w * n.to(x.dtype): round, then scale; output in "
        "promote(w, x)",
        "  swapped 2 (StreamsRMSNorm), which computes 'gemma, groups of 4': (n * (1 + w.float())).type_as(x): offset "
        "weight in fp32, round once, per group of 4 features of the row",
        "  swapped 3 (NormThenGateRMSNorm), which computes 'llama*silu(gate)': (w * n.to(x.dtype) * "
        "silu(gate.float())).to(x.dtype)",
    ]
    assert lines[5].startswith("  left alone 4 (LooksLikeLlamaButIsNot): computes none of torch, llama, gemma, t5, "
                               "centered, input_scaled (the RMSNorm variants rms_norm computes")
    assert re.search(r"closest: torch: largest difference [\d.]+, [\d.e+]+ times the spacing of float32 values there "
                     r"\(units in the last place\); 100% of the elements differ by more than rounding noise, with x "
                     r"float32, weight float32\)$", lines[5]), lines[5]
    assert lines[6] == ("  (x: the input; n = x * rsqrt(mean(x**2) + eps), computed in float32, float64 for float64 x; "
                        "w: the module's weight)")
    assert "units)" not in str(report) and " as " not in str(report)


@pytest.mark.parametrize("module, reason", [
    (GatedRMSNorm(16), "a gated norm that computes none of"),  # its gate: sigmoid in x's dtype
    (BiasRMSNorm(16), "has parameters other than weight (bias)"),
    (nn.Sequential(), None),  # not named like a norm: not examined
    (CustomLayerNorm(16), None),  # another norm: not examined past its structure, not reported
    (HardCodedEpsRMSNorm(16), "computes none of torch, llama, gemma, t5, centered, input_scaled"),
    (TrainOnlyScaleRMSNorm(16), "differs between train and eval mode"),
    (GroupRMSNorm(16), "computes none of torch, llama, gemma, t5, centered, input_scaled"),
])
def test_recognition_reasons(device, module, reason):
    found = recognize(module.to(device))
    if reason is None:
        assert found is None
    else:
        assert found.semantics is None and reason in found.reason, found


def test_structure_reasons_for_rmsnorm_named_modules():
    class TwoDimRMSNorm(LlamaStyleRMSNorm):
        def __init__(self):
            super().__init__(4)
            self.weight = nn.Parameter(torch.ones(2, 4))

    class BufferRMSNorm(LlamaStyleRMSNorm):
        def __init__(self):
            super().__init__(4)
            self.register_buffer("scale", torch.ones(4))

    class NoEpsRMSNorm(LlamaStyleRMSNorm):
        def __init__(self):
            super().__init__(4)
            del self.variance_epsilon

    replaced = LlamaStyleRMSNorm(4)
    replaced.forward = lambda x: x
    cases = [(TwoDimRMSNorm(), "weight is not 1-D"), (BufferRMSNorm(), "has buffers (scale)"),
             (NoEpsRMSNorm(), "no epsilon attribute"), (replaced, "its forward is replaced on the instance")]
    model = nn.ModuleList(m for m, _ in cases)
    report = T.patch_rmsnorm(model)
    assert report.swapped == []
    for (_, cls, why), (_, want) in zip(report.skipped, cases):
        assert why.startswith("named like an RMSNorm but not RMSNorm-like: ") and want in why, (cls, why)
    assert all(a is b for a, (b, _) in zip(model, cases))


def test_a_norm_with_hooks_is_swapped_and_its_hooks_run_only_on_the_models_calls(device):
    """The patched module shares the original's hooks, so a norm with hooks is swapped; the
    probe runs the module's forward, never its hooks nor global ones. ``recognize`` alone (a
    caller that would drop the hooks) still leaves it alone, with the reason."""
    from torch.nn.modules.module import register_module_forward_hook

    calls = []
    norm = LlamaStyleRMSNorm(16).to(device)
    norm.register_forward_hook(lambda module, args, out: calls.append("hook") or out * 2)
    norm.register_forward_pre_hook(lambda module, args: calls.append("pre-hook"))
    handle = register_module_forward_hook(lambda module, args, out: calls.append(type(module).__name__))
    try:
        assert "has hooks (forward_pre_hooks, forward_hooks)" in recognize(norm).reason
        model = nn.ModuleList([norm])
        reference = copy.deepcopy(norm)
        assert T.patch_rmsnorm(model).swapped == [("0", "LlamaStyleRMSNorm", "llama")]
        assert calls == []
        x = torch.randn(3, 16, device=device)
        torch.testing.assert_close(model[0](x), reference(x), **NORM_FP32)
        assert calls == ["pre-hook", "PatchedRMSNorm", "hook", "pre-hook", "LlamaStyleRMSNorm", "hook"]
    finally:
        handle.remove()


def test_probe_is_shared_only_by_modules_alike(device):
    """One probe serves modules of the same class, attributes and weight dtype; an attribute
    that changes what the forward computes gets its own."""
    model = nn.ModuleList([MaybeGroupedRMSNorm(16), MaybeGroupedRMSNorm(16), MaybeGroupedRMSNorm(16, group=4),
                           MaybeGroupedRMSNorm(16).to(torch.bfloat16)]).to(device)
    report = T.patch_rmsnorm(model)
    assert [row.name for row in report.swapped] == ["0", "1", "3"] and report.skipped[0].name == "2"
    assert all(model[i].weight is not model[j].weight for i, j in ((0, 1), (1, 3)))


def test_grouped_norms_are_swapped_with_the_group_their_attribute_names(device):
    """A norm over groups of the row that its ``group_size`` attribute names, each group scaled
    by its part of the weight, is swapped with a semantics per group (the kernels normalize the
    groups, torch applies the weight); it computes what the original does for every pair of
    dtypes, and so do its gradients."""
    model = nn.ModuleList([StreamsRMSNorm(16, group_size=4), StreamsRMSNorm(16, group_size=8, llama=True),
                           StreamsRMSNorm(16)]).to(device)
    with torch.no_grad():
        for m in model:
            m.weight.normal_()
    original = copy.deepcopy(model)
    report = T.patch_rmsnorm(model)
    assert report.semantics_counts() == {"gemma, groups of 4": 1, "llama, groups of 8": 1, "gemma": 1}, report
    for w_dtype in (torch.float32, torch.bfloat16):
        model.to(w_dtype)
        original.to(w_dtype)
        for x_dtype in (torch.float32, torch.bfloat16):
            for want_module, got_module in zip(original, model):
                x = torch.randn(3, 5, 16, device=device, dtype=x_dtype)
                assert_computes_like(want_module, got_module, x)
    model.float()
    original.float()
    x = torch.randn(6, 16, device=device, requires_grad=True)
    for want_module, got_module in zip(original, model):
        want = torch.autograd.grad(want_module(x).sin().sum(), (x, want_module.weight))
        with T.fallback_policy("error"):
            got = torch.autograd.grad(got_module(x).sin().sum(), (x, got_module.weight))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **grad_tol(torch.float32))


def test_swap_refused_when_rms_norm_disagrees(device, monkeypatch):
    """The chosen semantics also runs through rms_norm on the probe before the swap: an op
    that ignored the weight offset would leave Gemma-style modules alone, with the reason."""
    import torch_rmsnorm_op.recognize as recognize_module

    real = recognize_module.rms_norm
    monkeypatch.setattr(recognize_module, "rms_norm", lambda *args, weight_offset, **kw: real(*args, **kw))
    model = nn.Sequential(GemmaStyleRMSNorm(16), LlamaStyleRMSNorm(16)).to(device)
    report = T.patch_rmsnorm(model)
    assert [row.name for row in report.swapped] == ["1"]
    assert "computes gemma, but rms_norm disagrees on the probe" in report.skipped[0].reason


def test_epsilon_is_the_one_the_forward_uses(device):
    found = recognize(TwoEpsRMSNorm(16).to(device))
    assert found.semantics is LLAMA and found.eps == 2e-6
    assert recognize(LlamaStyleRMSNorm(16, eps=1e-5).to(device)).eps == 1e-5


def test_weightless_module_normalizes_any_last_dim(device):
    model = nn.Sequential(WeightlessRMSNorm())
    report = T.patch_rmsnorm(model)
    assert report.swapped == [("0", "WeightlessRMSNorm", "torch")] and not model[0].stand_in.weighted
    for n in (24, 48):
        x = torch.randn(3, n, device=device)
        torch.testing.assert_close(model[0](x), WeightlessRMSNorm()(x), **NORM_FP32)


# (semantics, x dtype, weight dtype) -> rms_norm's (weight_offset, norm_dtype, out_dtype); None = the default.
f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
KWARGS = [
    (TORCH, bf16, f32, (0.0, None, None)), (TORCH, f32, bf16, (0.0, None, None)),
    (LLAMA, f32, f32, (0.0, None, None)), (LLAMA, bf16, bf16, (0.0, bf16, None)), (LLAMA, bf16, f32, (0.0, bf16, f32)),
    (LLAMA, f32, bf16, (0.0, None, None)), (LLAMA, f16, None, (0.0, f16, None)),
    (GEMMA, bf16, bf16, (1.0, None, None)), (GEMMA, bf16, f32, (1.0, None, None)),
    (T5, bf16, bf16, (0.0, bf16, None)), (T5, f32, bf16, (0.0, bf16, bf16)), (T5, bf16, f32, (0.0, None, f32)),
    (T5, f16, bf16, (0.0, bf16, bf16)), (T5, f32, f32, (0.0, None, None)),
    (CENTERED, bf16, bf16, (0.0, None, None)), (CENTERED, f32, bf16, (0.0, None, None)),  # offset_weight adds it
]


def test_centered_semantics_add_the_offset_in_the_weights_dtype():
    weight = torch.tensor([0.3, -0.7], dtype=torch.bfloat16)
    assert torch.equal(CENTERED.offset_weight(weight), 1.0 + weight) and CENTERED.offset_weight(weight).dtype == bf16
    assert GEMMA.offset_weight(weight) is weight and CENTERED.offset_weight(None) is None
    x = torch.tensor([[1.5, 2.25]], dtype=torch.bfloat16)
    scaled, none = INPUT_SCALED.scale_input(x, weight)  # the norm then takes the scaled input, no weight
    assert none is None and torch.equal(scaled, (x.float() * (1.0 + weight).float()).to(bf16))
    same_x, same_weight = CENTERED.scale_input(x, weight)
    assert same_x is x and same_weight is weight


@pytest.mark.parametrize("semantics, x_dtype, w_dtype, want", KWARGS)
def test_semantics_kwargs(semantics, x_dtype, w_dtype, want):
    assert semantics.kwargs(x_dtype, w_dtype) == want


@pytest.mark.parametrize("cls", [LlamaStyleRMSNorm, Olmo2StyleRMSNorm, GemmaStyleRMSNorm, T5StyleLayerNorm,
                                 CenteredRMSNorm, InputScaledRMSNorm])
def test_dtype_change_after_patching_follows_the_original(device, cls):
    """The semantics hold for whatever dtypes arrive: model.to(bf16) after the patch, inputs
    of another dtype than the weight."""
    original = cls(64).to(device)
    with torch.no_grad():
        original.weight.normal_()
    model = nn.Sequential(original)
    T.patch_rmsnorm(model)
    for w_dtype in (torch.bfloat16, torch.float32):
        model.to(w_dtype)
        assert model[0].weight is original.weight
        for x_dtype in (torch.bfloat16, torch.float32):
            assert_computes_like(original, model[0], torch.randn(8, 64, device=device, dtype=x_dtype))


def test_patched_module_dtype_rules(device):
    """Llama's rule: output dtype is promote(weight, input); nn.RMSNorm's: the input's."""
    llama = LlamaStyleRMSNorm(32).to(device)  # fp32 weight
    torch_norm = nn.RMSNorm(32).to(device)
    model = nn.ModuleList([llama, torch_norm])
    T.patch_rmsnorm(model)
    x = torch.randn(4, 32, device=device, dtype=torch.bfloat16)
    assert model[0](x).dtype == llama(x).dtype == torch.float32
    assert model[1](x).dtype == torch_norm(x).dtype == torch.bfloat16


@pytest.mark.parametrize("shape", [(4, 8), (8,)])
def test_multi_dim_and_no_weight(device, shape):
    model = nn.Sequential(nn.RMSNorm(shape, elementwise_affine=False)).to(device)
    assert len(T.patch_rmsnorm(model).swapped) == 1
    x = torch.randn(3, *shape, device=device)
    torch.testing.assert_close(model(x), nn.functional.rms_norm(x, shape), **TOL[torch.float32])


def test_meta_parameters_are_skipped():
    with torch.device("meta"):
        model = nn.Sequential(nn.RMSNorm(8))
    report = T.patch_rmsnorm(model)
    assert report.swapped == [] and "meta" in report.skipped[0][2]


def test_root_module_is_reported_not_swapped():
    norm = nn.RMSNorm(8)
    report = T.patch_rmsnorm(norm)
    assert report.swapped == [] and "root module" in report.skipped[0][2]


def test_dynamic_hidden_size_compiles_once_where_the_op_stays_whole(device):
    """Frames compiled by the first call (torch may restart its analysis once within it, which
    the counter sees as a second frame). On CPU the op stays one call and later hidden sizes add
    no frame; on CUDA the graph holds the kernels' launches, whose configuration depends on N,
    so each new hidden size compiles one frame."""
    torch._dynamo.reset()
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    f = torch.compile(lambda x: T.rms_norm(x, (x.shape[-1],)), backend=counter, fullgraph=True, dynamic=True)
    first = None
    sizes = (8, 16, 24)
    for n in sizes:
        x = torch.randn(3, n, device=device)
        torch.testing.assert_close(f(x), nn.functional.rms_norm(x, (n,)), **TOL[torch.float32])
        first = first or counter.frame_count
    assert counter.frame_count == first + (len(sizes) - 1 if device.type == "cuda" else 0)


@pytest.mark.parametrize("cls", [LlamaStyleRMSNorm, GemmaStyleRMSNorm])
def test_patched_module_compiles_once_across_shapes(device, cls):
    """The per-call kwargs (dtype rules, the Gemma offset) are constants to the compiler: new
    batch shapes under dynamic=True and fullgraph=True recompile nothing."""
    torch._dynamo.reset()
    from torch._dynamo.testing import CompileCounterWithBackend

    model = nn.Sequential(cls(16)).to(device=device, dtype=torch.bfloat16)
    assert len(T.patch_rmsnorm(model).swapped) == 1
    counter = CompileCounterWithBackend("aot_eager")
    f = torch.compile(lambda x: model(x), backend=counter, fullgraph=True, dynamic=True)
    first = None
    for shape in ((3, 16), (5, 16), (8, 16)):
        x = torch.randn(shape, device=device, dtype=torch.bfloat16)
        assert f(x).dtype == model[0].original(x).dtype
        first = first or counter.frame_count
    assert counter.frame_count == first
    nodes = [n for g in counter.graphs for n in g.graph.nodes if "rmsnorm.fwd" in str(n.target)]
    assert nodes and all(n.kwargs["weight_offset"] == (1.0 if cls is GemmaStyleRMSNorm else 0.0) for n in nodes)


GATED = [
    (lambda: NormThenGateRMSNorm(16), "llama*silu(gate)", False),
    (lambda: Fp32SigmoidGateRMSNorm(16), "torch*sigmoid(gate)", False),
    (lambda: GateThenGroupNormRMSNorm(16, 16), "llama(x*silu(gate))", True),
    (lambda: GateThenGroupNormRMSNorm(16, 4), "llama(x*silu(gate)), groups of 4", True),
    (lambda: FalconH1StyleGatedRMSNorm(16, 2, True), "torch*silu(gate), groups of 8", True),
    (lambda: FalconH1StyleGatedRMSNorm(16, 1, False), "torch(x*silu(gate))", True),
]


@pytest.mark.parametrize("make, semantics, gate_optional", GATED, ids=[name for _, name, _ in GATED])
def test_gated_norms_are_swapped_by_what_they_compute(device, make, semantics, gate_optional):
    """A norm whose forward takes (hidden_states, gate) is probed like any other, against each
    form (the gate before or after the norm, silu or sigmoid, Llama's rounding or fp32, groups
    its attributes name) and swapped for a ``PatchedGatedRMSNorm``: outputs, their dtype and the
    gradients of x, the gate and the weight agree with the original's; without a gate it
    computes what the original does, or refuses where the original cannot run."""
    original = make().to(device)
    with torch.no_grad():
        original.weight.normal_(generator=torch.Generator(device).manual_seed(0))
    model = nn.ModuleList([original])
    report = T.patch_rmsnorm(model)
    assert report.swapped == [("0", type(original).__name__, semantics)], report
    patched = model[0]
    assert isinstance(patched, PatchedGatedRMSNorm) and patched.weight is original.weight
    gen = torch.Generator().manual_seed(1)
    for w_dtype in (torch.float32, torch.bfloat16):
        model.to(w_dtype)
        for x_dtype in (torch.float32, torch.bfloat16):
            x, gate = (torch.randn(3, 5, 16, generator=gen).to(device=device, dtype=x_dtype) for _ in range(2))
            assert_computes_like(original, patched, x, gate)
    model.float()
    x, gate = (torch.randn(6, 16, generator=gen, device="cpu").to(device).requires_grad_() for _ in range(2))
    dy = torch.randn(6, 16, generator=gen).to(device)
    want = torch.autograd.grad(original(x, gate), (x, gate, original.weight), dy)
    got = torch.autograd.grad(patched(x, gate), (x, gate, patched.weight), dy)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **grad_tol(torch.float32))
    if gate_optional:
        assert_computes_like(original, patched, x.detach())
    else:
        with pytest.raises(TypeError, match="gate is required"):
            patched(x)


def test_gated_norms_are_left_to_inductor(device):
    """Compiled, a gated norm's gate (before the norm or after it) and casts are elementwise
    ops around ``rmsnorm.fwd``, which the Inductor pass hands to Inductor with them, as the
    stock model's one fused kernel: no kernel of ours runs, outputs and gradients agree with
    the unpatched model; ``aot_eager`` (no Inductor pass) keeps one ``rmsnorm.fwd`` per norm."""
    from torch._dynamo.testing import CompileCounterWithBackend

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norms = nn.ModuleList([make() for make, _, _ in GATED])
            self.proj = nn.Linear(16, 32 * len(self.norms))

        def forward(self, x):
            parts = self.proj(x).chunk(2 * len(self.norms), dim=-1)
            return sum(norm(parts[2 * i], parts[2 * i + 1]) for i, norm in enumerate(self.norms))

    torch.manual_seed(0)
    model = Block().to(device)
    with torch.no_grad():
        for norm in model.norms:
            norm.weight.normal_()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 6, 16, device=device)
    want_out = reference(x)
    want = torch.autograd.grad(want_out.sum(), list(reference.parameters()))
    assert len(T.patch_rmsnorm(model).swapped) == len(GATED)
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        T.reset_dispatch_stats()
        counter = CompileCounterWithBackend(backend)
        out = torch.compile(model, backend=counter, fullgraph=True)(x)
        got = torch.autograd.grad(out.sum(), list(model.parameters()))
        torch.testing.assert_close(out, want_out, **MODEL[torch.float32])
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **MODEL[torch.float32])
        if backend == "aot_eager":
            assert sum("rmsnorm.fwd" in str(n.target) for n in counter.graphs[0].graph.nodes) == len(GATED)
        elif device.type == "cpu":  # a compiled CPU graph calls the ops it keeps: none
            assert not T.dispatch_stats()["kernel"], T.dispatch_stats()


@pytest.mark.parametrize("make", [lambda: NormThenGateRMSNorm(16), lambda: Fp32SigmoidGateRMSNorm(16),
                                  lambda: GateThenGroupNormRMSNorm(16, 4)], ids=["norm-then-gate", "fp32-sigmoid",
                                                                                 "gate-then-groups"])
def test_compiled_gated_norm_runs_the_modules_ops_in_its_order(device, make):
    """Left to Inductor, a patched gated norm's forward and backward graphs hold the ops of the
    module's own graphs in the module's order (the gate's activation where the module computes
    it), up to the casts a mixed-dtype product implies: Inductor groups ops into kernels from
    that order, so the patched norm compiles to the module's kernels."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class Record(CustomGraphPass):
        def __init__(self):
            self.graphs = []

        def __call__(self, graph):
            self.graphs.append([str(n.target) for n in graph.nodes if n.op == "call_function"
                                and n.target is not torch.ops.prims.convert_element_type.default])

        def uuid(self):
            return None

    original = make().to(device=device, dtype=torch.bfloat16)
    model = nn.ModuleList([copy.deepcopy(original)])
    assert len(T.patch_rmsnorm(model).swapped) == 1
    x, gate = (torch.randn(8, 16, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dy = torch.randn(8, 16, device=device, dtype=torch.bfloat16)
    recorded = []
    for module in (original, model[0]):
        record = Record()
        with compiling_afresh(), torch._inductor.config.patch(post_grad_custom_pre_pass=record):
            torch.compile(module, fullgraph=True)(x, gate).backward(dy)  # the backward compiles here
        recorded.append(record.graphs)
    assert len(recorded[0]) == 2 and recorded[1] == recorded[0], recorded
