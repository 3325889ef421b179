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
