"""A patched model behaves as the unpatched one under what users do to modules: parameters
replaced or loaded with ``assign``, device and dtype moves, ``meta`` and ``to_empty``,
attribute changes, hooks of every kind, ``deepcopy``, pickling, ``torch.save``/``torch.load``,
``torch.compile``, ``torch.fx`` and TorchScript; ``unpatch_rmsnorm`` after each returns every
original module as the model stands, computing what the unpatched model computes, bit for bit.

Each test changes a patched model and an unpatched copy (the reference) alike, through the
patched modules or through the original modules a user kept from before the patch."""

import copy
import io
import pickle

import numpy as np
import pytest
import torch
from checks import NormThenGateRMSNorm, WeightlessRMSNorm
from tolerances import MODEL
from torch import nn

import torch_rmsnorm_op as T
from torch_rmsnorm_op.tools.toy_models import GemmaStyleRMSNorm, LlamaStyleRMSNorm

D = 16


class GroupedRMSNorm(GemmaStyleRMSNorm):
    """Groups of ``group_size`` features normalized apart, scaled by their parts of ``1 + weight``."""

    def __init__(self, dim, group_size):
        super().__init__(dim)
        self.group_size = group_size

    def forward(self, x):
        g = x.float().unflatten(-1, (-1, self.group_size))
        n = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return (n * (1.0 + self.weight.float())).type_as(x)


class Model(nn.Module):
    """A norm of each kind the patcher swaps, one after the other with residual adds."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, 2 * D)
        self.norms = nn.ModuleDict(dict(torch=nn.RMSNorm(D, eps=1e-5), llama=LlamaStyleRMSNorm(D),
                                        gemma=GemmaStyleRMSNorm(D), weightless=WeightlessRMSNorm(),
                                        grouped=GroupedRMSNorm(D, 4)))
        self.gated = NormThenGateRMSNorm(D)

    def forward(self, x):
        h, gate = self.proj(x).chunk(2, dim=-1)
        for norm in self.norms.values():
            h = h + norm(h)
        return self.gated(h, gate)


SEMANTICS = {"torch": "torch", "llama": "llama", "gemma": "gemma", "weightless": "torch",
             "grouped": "gemma, groups of 4", "gated": "llama*silu(gate)"}


def _norms(model) -> dict:
    """The model's norms by name, as it holds them now (patched or not)."""
    return {**model.norms, "gated": model.gated}


def _pair(device, before=None):
    """``(reference, model, originals)``: an unpatched model, a copy of it patched, and the
    copy's norms as they were before the patch. ``before(norms)`` runs on both first."""
    torch.manual_seed(0)
    reference = Model().to(device)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name.endswith("weight") and param.dim() == 1:
                param.normal_(0.0, 0.5)
    model = copy.deepcopy(reference)
    if before is not None:
        before(_norms(reference))
        before(_norms(model))
    originals = _norms(model)
    keys = list(model.state_dict())
    assert list(reference.state_dict()) == keys  # each model's state_dict hooks run alike
    report = T.patch_rmsnorm(model)
    assert {row.name.rpartition(".")[2]: row.semantics for row in report.swapped} == SEMANTICS, report
    assert not report.skipped, report
    assert list(model.state_dict()) == keys == list(reference.state_dict())
    return reference, model, originals


def _outputs(model, x):
    """The model's output on ``x`` and the gradients of a loss of it (x's and every parameter's
    that requires one, by name)."""
    x = x.detach().requires_grad_()
    out = model(x)
    if out.device.type == "meta":
        return out, {}
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    grads = torch.autograd.grad((out.float() * torch.linspace(-1, 1, out.shape[-1], device=out.device)).sum(),
                                [x, *params.values()], allow_unused=True)
    return out, dict(zip(["x", *params], grads))


def _input(model, seed=1):
    param = model.proj.weight
    return torch.randn(3, 5, D, generator=torch.Generator().manual_seed(seed)).to(param.device, param.dtype)


def _assert_same(reference, model, exact=False):
    """``model`` computes what ``reference`` does: output and gradients (bit for bit with
    ``exact``, else within a whole model's tolerance of its dtype), state_dict, training flags."""
    x = _input(reference)
    want, want_grads = _outputs(reference, x)
    got, got_grads = _outputs(model, x)
    assert got.dtype == want.dtype and got.shape == want.shape and got.device == want.device
    assert got_grads.keys() == want_grads.keys()
    pairs = [(got, want)] + [(got_grads[k], want_grads[k]) for k in want_grads]
    for a, b in pairs:
        if b is None or b.device.type == "meta":
            assert a is None or a.device.type == "meta"
        elif exact:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, **MODEL[torch.bfloat16 if b.dtype == torch.bfloat16 else torch.float32])
    want_state, got_state = reference.state_dict(), model.state_dict()
    assert list(got_state) == list(want_state)
    for key, value in want_state.items():
        assert got_state[key].dtype == value.dtype and got_state[key].device == value.device, key
        if value.device.type != "meta":
            assert torch.equal(got_state[key], value), key
    assert [m.training for m in model.modules()] == [m.training for m in reference.modules()]


def _assert_unpatches(reference, model, originals):
    """``unpatch_rmsnorm`` puts back every original module, as the model stands: it computes
    what the reference computes, bit for bit, with the same state."""
    assert T.unpatch_rmsnorm(model) == len(SEMANTICS)
    norms = _norms(model)
    assert all(norms[name] is originals[name] for name in SEMANTICS)
    assert not any(isinstance(m, T.PatchedRMSNorm) for m in model.modules())
    for name, norm in _norms(reference).items():
        assert type(norms[name]) is type(norm)
        assert {k: (v.device, v.dtype) for k, v in norms[name].state_dict().items()} == \
            {k: (v.device, v.dtype) for k, v in norm.state_dict().items()}, name
        _assert_same_attributes(norms[name], norm)
    _assert_same(reference, model, exact=True)


def _assert_same_attributes(module, reference):
    """The same public attributes: equal values, equal tensors; functions (a forward set on
    the instance) by name only."""
    got, want = ({k: v for k, v in vars(m).items() if not k.startswith("_")} for m in (module, reference))
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), key
        elif not callable(value):
            assert type(got[key]) is type(value) and got[key] == value, key


def _new_weights(norms):
    gen = torch.Generator().manual_seed(2)
    for norm in norms.values():
        if getattr(norm, "weight", None) is not None:
            norm.weight = nn.Parameter(torch.randn(D, generator=gen).to(norm.weight.device))


def _set(**values):
    def change(norms):
        for name, attributes in values.items():
            for attribute, value in attributes.items():
                setattr(norms[name], attribute, value)
    return change


def _broadcast_weights(norms):
    for name in ("llama", "gemma", "grouped", "gated"):
        norms[name].weight = nn.Parameter(torch.full((1,), 1.5, device=norms[name].weight.device))


def _weight_as_tensor(norms):
    for name in ("llama", "torch"):
        weight = norms[name].weight
        del norms[name].weight
        norms[name].weight = weight.detach() * 2  # a plain tensor attribute, as a reparametrization leaves it


def _forward_on_instance(norms):
    norm = norms["llama"]
    norm.forward = lambda x: 2 * x  # an instance attribute: the module's call runs it


def _in_place(norms):
    with torch.no_grad():
        for norm in norms.values():
            if getattr(norm, "weight", None) is not None:
                norm.weight.mul_(-1.5).add_(0.25)


# What a user does to the norms of a model, through either the patched modules or the originals.
NORM_OPERATIONS = {
    "new weight Parameters": _new_weights,
    "weights changed in place": _in_place,
    "epsilons changed": _set(torch={"eps": 0.25}, llama={"variance_epsilon": 0.5}, weightless={"eps": 0.75},
                             gated={"variance_epsilon": 2.0}, grouped={"eps": 0.5, "variance_epsilon": 0.5},
                             gemma={"eps": 10.0, "variance_epsilon": 10.0}),
    "the one of two epsilons the forward reads changed": _set(gemma={"eps": 10.0}),
    "the one of two epsilons the forward does not read changed": _set(gemma={"variance_epsilon": 10.0}),
    "epsilons of other types": _set(torch={"eps": np.float32(0.25)}, llama={"variance_epsilon": np.float32(0.5)},
                                    weightless={"eps": torch.tensor(0.75)}),
    "the default epsilon": _set(torch={"eps": None}),
    "a group size changed": _set(grouped={"group_size": 8}),
    "an attribute the forward does not read added": _set(llama={"hidden_size": D}),
    "nn.RMSNorm's weight set to None": _set(torch={"weight": None}),
    "weights deleted and set as tensors": _weight_as_tensor,
    "weights of one element, which the forwards broadcast": _broadcast_weights,
    "a forward replaced on the instance": _forward_on_instance,
}


@pytest.mark.parametrize("through", ["patched", "originals"])
@pytest.mark.parametrize("operation", list(NORM_OPERATIONS))
def test_norm_changes_are_the_originals(device, operation, through):
    """A change made through the patched modules or through the originals the user kept is
    made to both (one state): the patched model computes what the reference computes after the
    same change, and unpatching returns the originals as changed."""
    reference, model, originals = _pair(device)
    NORM_OPERATIONS[operation](_norms(reference))
    NORM_OPERATIONS[operation](_norms(model) if through == "patched" else originals)
    for name in SEMANTICS:
        assert vars(_norms(model)[name]) is vars(originals[name])
    _assert_same(reference, model)
    _assert_unpatches(reference, model, originals)


def test_epsilon_set_on_a_hugging_face_norm_is_used(device):
    """``variance_epsilon`` set on a patched transformers norm is the one its calls use."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    original = LlamaRMSNorm(32).to(device)
    model = nn.ModuleList([original])
    reference = copy.deepcopy(model)
    assert len(T.patch_rmsnorm(model).swapped) == 1 and isinstance(model[0], T.PatchedRMSNorm)
    x = torch.randn(4, 32, device=device)
    for eps in (10.0, 1e-3):
        model[0].variance_epsilon = eps
        reference[0].variance_epsilon = eps
        torch.testing.assert_close(model[0](x), reference[0](x), **MODEL[torch.float32])
    assert original.variance_epsilon == 1e-3 and transformers is not None


def _state(seed, like):
    """A random state for ``like`` (read off its tensors, not its ``state_dict``: no hook runs)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = [*like.named_parameters(), *like.named_buffers()]
    return {k: torch.randn(v.shape, generator=gen).to(v.dtype) for k, v in tensors}


def _to_meta_and_back(model, device):
    model.to("meta")
    model.to_empty(device=device)
    model.load_state_dict(_state(4, model))


# What a user does to a whole model (on ``device``).
MODEL_OPERATIONS = {
    "load_state_dict(assign=True)": lambda m, device: m.load_state_dict(_state(3, m), assign=True),
    "load_state_dict": lambda m, device: m.load_state_dict(_state(3, m)),
    "to(bfloat16)": lambda m, device: m.to(torch.bfloat16),
    "half() then float()": lambda m, device: m.half().float(),
    "to(meta)": lambda m, device: m.to("meta"),
    "to(meta), to_empty(), load_state_dict": _to_meta_and_back,
    "to_empty(), load_state_dict": lambda m, device: (m.to_empty(device=device), m.load_state_dict(_state(5, m))),
    "eval()": lambda m, device: m.eval(),
    "requires_grad_(False) on the norms": lambda m, device: [n.requires_grad_(False) for n in _norms(m).values()],
    "zero_grad() after a backward": lambda m, device: (m(_input(m)).sum().backward(), m.zero_grad()),
}


@pytest.mark.parametrize("operation", list(MODEL_OPERATIONS))
def test_model_operations_reach_the_originals(device, operation):
    """Whole-model operations (loading, device and dtype moves, meta, to_empty, modes) change
    the originals' state with the patched modules': after ``.to("meta")`` the unpatched norms
    are on the meta device, after ``.to(bfloat16)`` in bfloat16, after an assign-load they hold
    the loaded tensors."""
    reference, model, originals = _pair(device)
    MODEL_OPERATIONS[operation](reference, device)
    MODEL_OPERATIONS[operation](model, device)
    if operation == "to(meta)":
        assert all(p.device.type == "meta" for n in originals.values() for p in n.parameters())
    if operation == "load_state_dict(assign=True)":
        assert originals["llama"].weight is model.norms["llama"].weight
    _assert_same(reference, model)
    _assert_unpatches(reference, model, originals)


def _hooks(log: list) -> dict:
    """Each kind of hook, as a function registering it on a module; every call of a hook
    changes what the module computes, saves or loads, and is recorded in ``log``."""

    def scale_input(module, args):
        log.append("forward pre-hook")
        return (args[0] * 2, *args[1:])

    def shift_output(module, args, output):
        log.append("forward hook")
        return output + 0.5

    def scale_kwargs_input(module, args, kwargs):
        log.append("forward pre-hook with kwargs")
        return (args[0] * 3, *args[1:]), kwargs

    def shift_kwargs_output(module, args, kwargs, output):
        log.append("forward hook with kwargs")
        return output - 0.25

    def scale_grad_input(module, grad_input, grad_output):
        log.append("full backward hook")
        return tuple(None if g is None else 2 * g for g in grad_input)

    def scale_grad_output(module, grad_output):
        log.append("backward pre-hook")
        return tuple(None if g is None else 3 * g for g in grad_output)

    def state_dict_post(module, state_dict, prefix, local_metadata):
        log.append(f"state_dict post-hook {prefix}")
        if prefix + "weight" in state_dict:
            state_dict[prefix + "weight"] = state_dict[prefix + "weight"] * 0 + 7

    def state_dict_pre(module, prefix, keep_vars):
        log.append(f"state_dict pre-hook {prefix}")

    def load_pre(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        log.append(f"load_state_dict pre-hook {prefix}")
        if prefix + "weight" in state_dict:
            state_dict[prefix + "weight"] = state_dict[prefix + "weight"] * 2

    def load_post(module, incompatible_keys):
        log.append("load_state_dict post-hook")
        if getattr(module, "weight", None) is not None:
            with torch.no_grad():
                module.weight.add_(1.0)

    return {
        "forward pre-hook": lambda m: m.register_forward_pre_hook(scale_input),
        "forward hook": lambda m: m.register_forward_hook(shift_output),
        "forward pre-hook with kwargs": lambda m: m.register_forward_pre_hook(scale_kwargs_input, with_kwargs=True),
        "forward hook with kwargs, always called": lambda m: m.register_forward_hook(
            shift_kwargs_output, with_kwargs=True, always_call=True),
        "full backward hook": lambda m: m.register_full_backward_hook(scale_grad_input),
        "backward pre-hook": lambda m: m.register_full_backward_pre_hook(scale_grad_output),
        "state_dict post-hook": lambda m: m.register_state_dict_post_hook(state_dict_post),
        "state_dict pre-hook": lambda m: m.register_state_dict_pre_hook(state_dict_pre),
        "load_state_dict pre-hook": lambda m: m.register_load_state_dict_pre_hook(load_pre),
        "load_state_dict post-hook": lambda m: m.register_load_state_dict_post_hook(load_post),
    }


HOOKS = list(_hooks([]))


@pytest.mark.parametrize("when", ["before the patch", "after the patch"])
@pytest.mark.parametrize("hook", HOOKS)
def test_hooks_of_every_kind_are_kept(device, hook, when):
    """A hook registered on a norm before the patch (on the original) or after it (on the
    patched module) runs as often and does what it does on the unpatched model (the norm is
    swapped, not left alone); it is still there after unpatching, and removing it through its
    handle removes it from both."""
    logs = {"reference": [], "model": []}
    handles = {"reference": [], "model": []}

    def register(norms, key):
        handles[key] += [_hooks(logs[key])[hook](norm) for norm in norms.values()]

    if when == "before the patch":
        keys = iter(["reference", "model"])
        reference, model, originals = _pair(device, before=lambda norms: register(norms, next(keys)))
    else:
        reference, model, originals = _pair(device)
        register(_norms(reference), "reference")
        register(_norms(model), "model")
    _assert_same(reference, model)
    state = _state(6, reference)
    reference.load_state_dict(state)
    model.load_state_dict(state)
    _assert_same(reference, model)
    assert logs["model"] == logs["reference"] and logs["model"], logs
    for key in handles:  # some removed through their handles, from the patched module and the original alike
        for handle in handles[key][:3]:
            handle.remove()
    _assert_same(reference, model)
    _assert_unpatches(reference, model, originals)
    assert logs["model"] == logs["reference"]


def test_global_module_hooks_see_the_patched_calls(device):
    """Global forward pre-hooks and hooks run on the patched norms' calls as on the originals'
    (once per call: a call the stand-in hands to the original's forward runs no hook twice)."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    reference, model, originals = _pair(device)
    originals["gemma"].eps = 0.5  # one norm whose calls run its original forward
    reference.norms["gemma"].eps = 0.5
    seen = []
    handles = [register_module_forward_pre_hook(lambda m, args: seen.append(type(m).__name__)),
               register_module_forward_hook(lambda m, args, out: out * 1.5 if isinstance(out, torch.Tensor) else out)]
    try:
        _assert_same(reference, model)
        reference_calls, model_calls = seen[: len(seen) // 2], seen[len(seen) // 2:]
        assert len(model_calls) == len(reference_calls) == 2 + len(SEMANTICS)
        assert model_calls.count("PatchedRMSNorm") + model_calls.count("PatchedGatedRMSNorm") == len(SEMANTICS)
        _assert_unpatches(reference, model, originals)
    finally:
        for handle in handles:
            handle.remove()


def _pickled(model):
    return pickle.loads(pickle.dumps(model))


def _saved(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIES = {"deepcopy": copy.deepcopy, "pickle": _pickled, "torch.save/torch.load": _saved}


@pytest.mark.parametrize("how", list(COPIES))
def test_copies_keep_each_stand_in_with_its_own_original(device, how):
    """A copy of a patched model (deepcopy, pickle, torch.save/load) computes what the model
    does; each patched module of the copy stands in for the copy of its original, sharing its
    state, and neither model's changes reach the other; unpatching the copy gives the copied
    originals as the copy stands."""
    reference, model, originals = _pair(device)
    copied = COPIES[how](model)
    copies = _norms(copied)
    for name in SEMANTICS:
        assert type(copies[name]) is type(_norms(model)[name])
        assert copies[name].original is not originals[name]
        assert vars(copies[name]) is vars(copies[name].original)
        assert copies[name].semantics == _norms(model)[name].semantics
    _assert_same(reference, copied)
    copied_reference = copy.deepcopy(reference)
    for target in (_norms(copied_reference), copies):
        _new_weights(target)
        _set(llama={"variance_epsilon": 0.5})(target)
    _assert_same(copied_reference, copied)
    _assert_same(reference, model)  # the model is as it was
    copied_originals = {name: copies[name].original for name in SEMANTICS}
    _assert_unpatches(copied_reference, copied, copied_originals)
    _assert_unpatches(reference, model, originals)


def test_shallow_copy_shares_the_state(device):
    _, model, originals = _pair(device)
    shallow = copy.copy(model.norms["llama"])
    assert type(shallow) is T.PatchedRMSNorm and shallow.original is originals["llama"]
    shallow.variance_epsilon = 0.125
    assert originals["llama"].variance_epsilon == 0.125


def test_compiled_model_follows_changes(device):
    """A compiled patched model recompiles where a change calls for it (an epsilon, a group
    size) and reads the parameters as they are (a new Parameter, an assign-load): each step
    matches the unpatched model."""
    from torch._dynamo.testing import CompileCounterWithBackend

    reference, model, originals = _pair(device)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter)
    x = _input(reference)
    steps = [lambda m: None, _new_weights, _set(llama={"variance_epsilon": 0.5}, torch={"eps": 0.125}),
             _set(grouped={"group_size": 8}), _set(gemma={"eps": 0.25})]
    for step in steps:
        step(_norms(reference))
        step(_norms(model))
        torch.testing.assert_close(compiled(x), reference(x), **MODEL[torch.float32])
    model.load_state_dict(_state(7, model), assign=True)
    reference.load_state_dict(_state(7, reference), assign=True)
    torch.testing.assert_close(compiled(x), reference(x), **MODEL[torch.float32])
    assert counter.frame_count >= 2  # the epsilons are constants of a graph: a change compiles another
    _assert_unpatches(reference, model, originals)


def test_symbolic_trace_of_a_patched_model(device):
    """``torch.fx.symbolic_trace`` of a patched model records each patched norm as one module
    call (the input's dtype decides its keywords when it runs), as it records ``nn.RMSNorm``;
    the traced module computes what the patched model does, bit for bit. Traced alone, a
    patched norm traces its original's forward."""
    reference, model, originals = _pair(device)
    traced = torch.fx.symbolic_trace(model)
    calls = [n.target for n in traced.graph.nodes if n.op == "call_module"]
    assert calls == ["proj", *(f"norms.{name}" for name in model.norms), "gated"], calls
    x = _input(model)
    assert torch.equal(traced(x), model(x))
    alone = torch.fx.symbolic_trace(model.norms["llama"])
    h = x[..., :D]
    torch.testing.assert_close(alone(h), reference.norms["llama"](h), **MODEL[torch.float32])
    model.bfloat16()  # the traced module calls the model's modules: their new dtype decides their keywords
    with torch.no_grad():
        assert torch.equal(traced(x.bfloat16()), model(x.bfloat16()))


def test_torchscript_says_what_to_do_and_leaves_the_model_patched(device):
    """TorchScript cannot compile the patched norms (they run the ops from Python): scripting a
    patched model raises an error that names this library and what to do, and leaves the
    model as it was; unpatched, it scripts."""
    norm = nn.RMSNorm(D).to(device)
    model = nn.Sequential(nn.Linear(D, D), norm).to(device)
    assert len(T.patch_rmsnorm(model).swapped) == 1
    with pytest.raises(RuntimeError, match="torch_rmsnorm_op: TorchScript cannot compile PatchedRMSNorm.*"
                                           "torch.compile or torch.export.*unpatch_rmsnorm"):
        torch.jit.script(model)
    assert isinstance(model[1], T.PatchedRMSNorm) and model[1].original is norm
    T.unpatch_rmsnorm(model)
    scripted = torch.jit.script(model)
    x = torch.randn(3, D, device=device)
    assert torch.equal(scripted(x), model(x))


def test_unpatch_refuses_a_parametrization_added_after_the_patch(device):
    """A parametrization registered on a patched norm changes its class, which the original
    does not share: ``unpatch_rmsnorm`` refuses, naming it, before putting anything back."""

    class Doubled(nn.Module):
        def forward(self, w):
            return 2 * w

    reference, model, originals = _pair(device)
    torch.nn.utils.parametrize.register_parametrization(model.norms["llama"], "weight", Doubled())
    torch.nn.utils.parametrize.register_parametrization(reference.norms["llama"], "weight", Doubled())
    _assert_same(reference, model)
    with pytest.raises(ValueError, match="norms.llama has a parametrization"):
        T.unpatch_rmsnorm(model)
    assert isinstance(model.norms["torch"], T.PatchedRMSNorm)  # nothing put back
    torch.nn.utils.parametrize.remove_parametrizations(model.norms["llama"], "weight")
    torch.nn.utils.parametrize.remove_parametrizations(reference.norms["llama"], "weight")
    _assert_unpatches(reference, model, originals)
