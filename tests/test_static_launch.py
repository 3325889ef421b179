"""Inductor's static launcher for our kernels: what patching sets, how it is turned off, and on
CUDA that a compiled patched model's generated code launches our kernels through it."""

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
from torch import nn
from torch._inductor import config as inductor_config

import torch_rmsnorm_op
from torch_rmsnorm_op import _torch_compat, static_launch


@pytest.fixture
def clean(monkeypatch):
    """No static-launch setting from earlier tests; everything put back afterwards."""
    static_launch._undo()
    monkeypatch.delenv(static_launch.ENV_VAR, raising=False)
    monkeypatch.delenv(static_launch.INDUCTOR_ENV_VAR, raising=False)
    monkeypatch.setattr(static_launch, "_enabled", None)
    yield
    static_launch._undo()


def _patch_one_norm() -> torch_rmsnorm_op.PatchReport:
    report = torch_rmsnorm_op.patch_rmsnorm(nn.Sequential(nn.Linear(8, 8), nn.RMSNorm(8)))
    assert len(report.swapped) == 1
    return report


def test_patching_turns_static_launch_on_for_compile_workers_and_this_process(clean):
    assert not inductor_config.static_launch_user_defined_triton_kernels
    _patch_one_norm()
    assert os.environ[static_launch.INDUCTOR_ENV_VAR] == "1"
    assert inductor_config.static_launch_user_defined_triton_kernels
    _patch_one_norm()  # a second patch changes nothing
    assert os.environ[static_launch.INDUCTOR_ENV_VAR] == "1"

    static_launch.set_static_launch(False)  # undoes what patching set
    assert static_launch.INDUCTOR_ENV_VAR not in os.environ
    assert not inductor_config.static_launch_user_defined_triton_kernels
    _patch_one_norm()
    assert static_launch.INDUCTOR_ENV_VAR not in os.environ
    static_launch.set_static_launch(None)
    _patch_one_norm()
    assert inductor_config.static_launch_user_defined_triton_kernels


@pytest.mark.parametrize("value", ["0", "off"])
def test_environment_variable_turns_it_off(clean, monkeypatch, value):
    monkeypatch.setenv(static_launch.ENV_VAR, value)
    assert not static_launch.static_launch_enabled()
    _patch_one_norm()
    assert static_launch.INDUCTOR_ENV_VAR not in os.environ
    assert not inductor_config.static_launch_user_defined_triton_kernels


def test_inductor_variable_set_by_the_user_stands(clean, monkeypatch):
    monkeypatch.setenv(static_launch.INDUCTOR_ENV_VAR, "0")
    _patch_one_norm()
    assert os.environ[static_launch.INDUCTOR_ENV_VAR] == "0"
    assert not inductor_config.static_launch_user_defined_triton_kernels
    static_launch.set_static_launch(False)  # nothing of ours to undo: the user's value stays
    assert os.environ[static_launch.INDUCTOR_ENV_VAR] == "0"


def test_a_torch_without_the_option_is_left_as_it_is(clean, monkeypatch):
    monkeypatch.setattr(static_launch, "_OPTION", "no_such_option")
    _patch_one_norm()
    assert static_launch.INDUCTOR_ENV_VAR not in os.environ


def test_workers_started_before_patching_are_named_in_a_warning(clean, monkeypatch, caplog):
    monkeypatch.setattr(_torch_compat, "compile_workers_running", lambda: True)
    with caplog.at_level(logging.WARNING, logger="torch_rmsnorm_op"):
        _patch_one_norm()
    assert any("compile workers started before" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="torch_rmsnorm_op"):
        _patch_one_norm()  # said once, when it is set
    assert not caplog.records


def test_tracing_an_op_turns_static_launch_on(clean):
    """A graph that calls the ops without patching (``rms_norm``, ``RMSNorm``): their fake
    implementations, which run while Dynamo captures it, set what patching sets; with the
    setting off, nothing."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, 8)
        torch.ops.rmsnorm.fwd(x, None, 1e-6)
    assert os.environ[static_launch.INDUCTOR_ENV_VAR] == "1"
    assert inductor_config.static_launch_user_defined_triton_kernels
    static_launch.set_static_launch(False)
    with FakeTensorMode():
        torch.ops.rmsnorm.add_fwd(torch.empty(4, 8), torch.empty(4, 8), None, 1e-6)
    assert static_launch.INDUCTOR_ENV_VAR not in os.environ
    assert not inductor_config.static_launch_user_defined_triton_kernels


_LAUNCHERS = textwrap.dedent("""
    import collections
    import json
    import sys
    import torch
    from torch import nn
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    import torch_rmsnorm_op

    norm = torch_rmsnorm_op.RMSNorm if sys.argv[1] == "module" else nn.RMSNorm
    model = nn.Sequential(nn.Linear(256, 256), norm(256), nn.Linear(256, 256), norm(256))
    model = model.to("cuda", torch.bfloat16)
    if sys.argv[1] == "patched":
        torch_rmsnorm_op.patch_rmsnorm(model)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with torch_rmsnorm_op.fallback_policy("error"):
        torch.compile(model, fullgraph=True)(x).sum().backward()
    kinds = collections.Counter()
    for module in list(PyCodeCache.modules) + list(PyCodeCache.modules_no_attr.values()):
        for name, kernel in vars(module).items():
            if isinstance(kernel, CachingAutotuner) and name.startswith("_rms_norm"):
                kinds.update(type(r).__name__ for r in kernel.compile_results)
    print(json.dumps(kinds))
""")


@pytest.mark.cuda
@pytest.mark.parametrize("setting", ["1", "0"])
@pytest.mark.parametrize("model", ["patched", "module"])
def test_compiled_patched_model_launches_our_kernels_statically(setting, model):
    """In a fresh process, a model patched before the first compile, as users do, or built with
    ``torch_rmsnorm_op.RMSNorm`` and never patched: the generated code's launchers of our
    kernels are Inductor's static ones, or Triton's with the setting off."""
    env = {**os.environ, static_launch.ENV_VAR: setting, "TORCHINDUCTOR_FX_GRAPH_CACHE": "0"}
    env.pop(static_launch.INDUCTOR_ENV_VAR, None)
    out = subprocess.run([sys.executable, "-c", _LAUNCHERS, model], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    kinds = json.loads(out.stdout.strip().splitlines()[-1])
    want = "StaticTritonCompileResult" if setting == "1" else "TritonCompileResult"
    assert set(kinds) == {want}, kinds
    assert kinds[want] >= 2  # the forward and backward kernels at least


class _Fake:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _compiled(signature: dict, constants: dict, num_ctas: int = 1, cooperative: bool = False) -> _Fake:
    """What ``_triton_compat`` reads of a Triton 3.6 ``CompiledKernel``."""
    names = list(signature)
    return _Fake(src=_Fake(fn=_Fake(arg_names=names), signature=signature, constants=constants),
                 metadata=_Fake(num_ctas=num_ctas, num_warps=8, shared=1024), function=1234,
                 run=_Fake(launch_cooperative_grid=cooperative, launch_pdl=False))


def test_eager_static_launch_passes_the_binary_its_parameters():
    """The eager launches through torch's static launcher: every parameter in order goes in,
    the constexprs (a None pointer, an int Triton specialized as 1, the declared ones) are
    dropped, Triton 3.6's two scratch pointers are appended as null, and each scalar is typed
    as Triton typed it; a kernel with a parameter type the launcher does not take, clusters or
    a cooperative launch keeps Triton's launcher."""
    from torch_rmsnorm_op import _triton_compat

    signature = {"x": "*bf16", "r": "constexpr", "w": "*fp32", "m": "i32", "n": "constexpr", "eps": "fp32",
                 "big": "i64", "BLOCK": "constexpr"}
    compiled = _compiled(signature, {(1,): None, (4,): 1, (7,): 256})
    assert _triton_compat.static_parameters(compiled) == ([0, 2, 3, 5, 6], "OOiflOO")
    launches = []
    call = _triton_compat._static_call(compiled, lambda *a: launches.append(a))
    call(3, 1, 1, 77, 1000, None, 2000, 5, 1, 1e-6, 2**40, 256)
    assert launches == [(1234, 3, 1, 1, 8, 1024, "OOiflOO", (1000, 2000, 5, 1e-6, 2**40, None, None), 77)]
    assert _triton_compat._static_call(compiled, None) is None  # a torch without the launcher
    for other in (_compiled({**signature, "flag": "i1"}, {}), _compiled(signature, {}, num_ctas=2),
                  _compiled(signature, {}, cooperative=True)):
        assert _triton_compat._static_call(other, lambda *a: None) is None


@pytest.mark.cuda
def test_eager_launches_through_either_launcher_give_the_same_bits(monkeypatch):
    """Eager forwards and backwards (a replayed plan, single-pass, looped and split launches,
    the dweight reduction) launched through torch's static launcher give Triton's launcher's
    bits; ``set_static_launch(False)`` keeps Triton's for kernels compiled afterwards."""
    import torch
    import triton

    from torch_rmsnorm_op import _triton_compat, dispatch

    if not triton.__version__.startswith("3.6.") or _torch_compat.static_cuda_launch() is None:
        pytest.skip("the static eager launch serves Triton 3.6 with a torch that has the launcher")
    torch.manual_seed(0)
    inputs = [(torch.randn(m, n, device="cuda", dtype=dtype), torch.rand(n, device="cuda", dtype=dtype) + 0.5)
              for m, n, dtype in ((128, 257, torch.float32), (300, 4096, torch.bfloat16), (4, 65536, torch.bfloat16),
                                  (2048, 2048, torch.float16))]

    def run_all() -> list:
        results = []
        for x, w in inputs:
            for _ in range(3):  # the JIT, the compiled kernel's launcher, the plan's replay
                xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
                y = torch_rmsnorm_op.rms_norm(xg, (x.shape[-1],), wg, 1e-6)
                y.backward(torch.ones_like(y))
                with torch.no_grad():
                    results.append((y, xg.grad, wg.grad, torch_rmsnorm_op.rms_norm(x, (x.shape[-1],), w, 1e-6)))
        return results

    runs = []
    for enabled in (True, False):
        monkeypatch.setattr(_triton_compat, "_COMPILED", {})
        monkeypatch.setattr(dispatch, "_PLANS", {})
        monkeypatch.setattr(static_launch, "_enabled", enabled)
        results = run_all()
        runs.append((results, {launcher.head == () for launcher in _triton_compat._COMPILED.values()}))
    (static, static_kinds), (triton_c, triton_kinds) = runs
    assert static_kinds == {True} and triton_kinds == {False}
    for a, b in zip(static, triton_c):
        assert all(torch.equal(u, v) for u, v in zip(a, b))
