"""The fallback policy: both paths, every way of setting it, counters, logs, profiler, compile."""

import logging
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from checks import compiling_afresh
from tolerances import NORM_FP32, grad_tol

import torch_rmsnorm_op as T
from torch_rmsnorm_op import dispatch, fallback

FP64_REASON = "rmsnorm.fwd: x dtype torch.float64 (kernels serve float16, bfloat16, float32)"


def _fp64(device):
    return torch.randn(3, 8, device=device, dtype=torch.float64), torch.randn(8, device=device, dtype=torch.float64)


def test_default_policy_warns_once_per_reason(device):
    assert T.get_fallback_policy() == "warn"
    x, w = _fp64(device)
    with pytest.warns(UserWarning, match="falls back to the PyTorch reference") as record:
        T.rms_norm(x, (8,), w)
    assert record[0].filename == __file__  # the caller's line, not ours or the dispatcher's
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = T.rms_norm(x, (8,), w)  # same reason: no second warning
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x, (8,), w))
    assert T.dispatch_stats()["fallback"] == {FP64_REASON: 2}


def test_reference_policy_counts_and_logs(device, caplog):
    x, w = _fp64(device)
    T.set_fallback_policy("reference")
    with caplog.at_level(logging.DEBUG, logger="torch_rmsnorm_op"):
        T.rms_norm(x, (8,), w)
    assert "PyTorch reference fallback" in caplog.text and "float64" in caplog.text
    assert T.dispatch_stats()["fallback"] == {FP64_REASON: 1}
    assert T.dispatch_stats()["kernel"] == {}


def test_error_policy_raises_before_any_output(device):
    x, w = _fp64(device)
    with T.fallback_policy("error"):
        with pytest.raises(T.FallbackError, match=r"float64.*set_fallback_policy\('reference'\)"):
            T.rms_norm(x, (8,), w)
    assert T.get_fallback_policy() == "warn"  # the context manager restored it
    assert T.dispatch_stats() == {"kernel": {}, "fallback": {}, "compiled": {}, "sites": {}}


def test_kernel_path_is_counted(device):
    with T.fallback_policy("error"):
        x = torch.randn(4, 16, device=device, requires_grad=True)
        T.rms_norm(x, (16,), None).sum().backward()
    assert T.dispatch_stats() == {"kernel": {"rmsnorm.fwd": 1, "rmsnorm.bwd": 1}, "fallback": {}, "compiled": {}, "sites": {}}


def test_probing_scopes_the_policy_and_the_counts_to_its_own_thread(device):
    """The patcher's probes (``fallback.probing``) run under "reference" and count nothing, in
    the thread that probes; a call from another thread meanwhile keeps the user's policy and
    is counted."""
    import threading

    x, w = _fp64(device)
    started, release, seen = threading.Event(), threading.Event(), {}

    def probe():
        with fallback.probing():
            seen["policy"] = T.get_fallback_policy()
            T.rms_norm(x, (8,), w)  # a fallback, neither raised nor counted
            started.set()
            release.wait(timeout=30)

    T.reset_dispatch_stats()
    with T.fallback_policy("error"):
        thread = threading.Thread(target=probe)
        thread.start()
        assert started.wait(timeout=30)
        try:
            assert T.get_fallback_policy() == "error"
            with pytest.raises(T.FallbackError, match="float64"):
                T.rms_norm(x, (8,), w)
            T.rms_norm(x.float(), (8,), w.float())
        finally:
            release.set()
            thread.join()
    assert seen["policy"] == "reference"
    assert T.dispatch_stats() == {"kernel": {"rmsnorm.fwd": 1}, "fallback": {}, "compiled": {}, "sites": {}}


@pytest.mark.parametrize("make", [
    lambda d: torch.randn(8, 6, device=d).t(),  # a last dim that is not contiguous
    lambda d: torch.randn(2, 12, 10, device=d).transpose(1, 2).unflatten(-1, (3, 4)),  # conv output, per head
    lambda d: torch.randn(2, 3, 4, 5, 8, device=d).permute(3, 2, 1, 0, 4),  # more than three strides
], ids=["transposed", "heads-of-transposed", "four-strides"])
def test_rows_the_kernels_cannot_address_in_place_are_copied_not_a_fallback(device, make):
    """The ops run the kernels on a contiguous copy of such rows: the same bits as on
    ``x.contiguous()``, for every op and both directions, counted as kernel calls."""
    x = make(device)
    n = x.shape[-1]
    w, r = torch.randn(n, device=device), torch.randn(x.shape, device=device)
    dy = torch.randn(x.shape, device=device)
    c = x.contiguous()
    with T.fallback_policy("error"):
        for got, want in (
            (torch.ops.rmsnorm.fwd(x, w, 1e-6), torch.ops.rmsnorm.fwd(c, w, 1e-6)),
            (torch.ops.rmsnorm.add_fwd(x, r, w, 1e-6), torch.ops.rmsnorm.add_fwd(c, r, w, 1e-6)),
            (torch.ops.rmsnorm.norm_add_fwd(x, r, w, 1e-6, w, 1e-5), torch.ops.rmsnorm.norm_add_fwd(c, r, w, 1e-6, w, 1e-5)),
        ):
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        rstd = torch.ops.rmsnorm.fwd(c, w, 1e-6)[1]
        got, want = torch.ops.rmsnorm.bwd(dy, x, w, rstd), torch.ops.rmsnorm.bwd(dy, c, w, rstd)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        xg, wg = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
        y = T.rms_norm(xg, (n,), wg)
        grads = torch.autograd.grad(y, (xg, wg), dy)
    xr, wr = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
    want = F.rms_norm(xr, (n,), wr)
    torch.testing.assert_close(y, want, **NORM_FP32)
    for a, b in zip(grads, torch.autograd.grad(want, (xr, wr), dy), strict=True):
        torch.testing.assert_close(a, b, **grad_tol(torch.float32))
    stats = T.dispatch_stats()
    assert stats["fallback"] == {} and stats["kernel"]["rmsnorm.bwd"] == 3
    # Compiled (on CUDA the graph holds the copy and the kernels' launches): the same values.
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w: T.rms_norm(x, (n,), w), backend="aot_eager", fullgraph=True)
    xg, wg = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
    with T.fallback_policy("error"):
        y_compiled = compiled(xg, wg)
        compiled_grads = torch.autograd.grad(y_compiled, (xg, wg), dy)
    torch.testing.assert_close(y_compiled, y, **NORM_FP32)
    for a, b in zip(compiled_grads, grads, strict=True):
        torch.testing.assert_close(a, b, **grad_tol(torch.float32))
    assert T.dispatch_stats()["fallback"] == {}


def test_views_the_kernels_address_need_no_fallback(device):
    """Rows over two or three strides (a transposed head view, a slice of one) run on the kernels."""
    base = torch.randn(2, 5, 3, 8, device=device)
    for x in (base.transpose(1, 2), base.transpose(1, 2)[:, :, 1:], base[0].transpose(0, 1)):
        with T.fallback_policy("error"):
            y = T.rms_norm(x, (8,))
        torch.testing.assert_close(y, torch.nn.functional.rms_norm(x, (8,)))


def test_n_above_maximum_falls_back(device, monkeypatch):
    monkeypatch.setattr(dispatch, "MAX_N", 64)
    monkeypatch.setattr(dispatch, "_PLANS", {})
    x = torch.randn(2, 65, device=device)
    with T.fallback_policy("error"), pytest.raises(T.FallbackError, match="N = 65 above the kernels' maximum 64"):
        T.rms_norm(x, (65,))
    with T.fallback_policy("reference"):
        torch.testing.assert_close(T.rms_norm(x, (65,)), torch.nn.functional.rms_norm(x, (65,)))


def test_environment_variable(device, monkeypatch):
    monkeypatch.setenv(fallback.ENV_VAR, "error")
    x, w = _fp64(device)
    with pytest.raises(T.FallbackError):
        T.rms_norm(x, (8,), w)
    T.set_fallback_policy("reference")  # explicit setting wins over the environment
    T.rms_norm(x, (8,), w)
    T.set_fallback_policy(None)
    monkeypatch.setenv(fallback.ENV_VAR, "sometimes")
    with pytest.raises(ValueError, match="TORCH_RMSNORM_OP_FALLBACK"):
        T.rms_norm(x, (8,), w)
    with pytest.raises(ValueError, match="must be one of"):
        T.set_fallback_policy("never")


def test_fallback_visible_in_profiler(device):
    x, w = _fp64(device)
    with T.fallback_policy("reference"), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        T.rms_norm(x, (8,), w)
    names = {e.name for e in prof.events()}
    assert "rmsnorm.fwd [reference fallback]" in names and "rmsnorm::fwd" in names


def test_policy_holds_under_compile(device):
    """On CPU a compiled graph keeps the op whole: decided and counted per call. On CUDA the
    decision is taken while tracing: counted once for the call site, the graph then holds the
    reference's operations, and "error" raises while compiling."""
    x, w = _fp64(device)
    with compiling_afresh():
        f = torch.compile(lambda x, w: T.rms_norm(x, (8,), w), fullgraph=True, backend="aot_eager")
        with T.fallback_policy("reference"):
            f(x, w)
            f(x, w)
    stats = T.dispatch_stats()
    if device.type == "cuda":
        assert stats["fallback"] == {} and stats["compiled"] == {
            FP64_REASON.replace("rmsnorm.fwd: ", "rmsnorm.fwd: reference (") + ")": 1}
        with compiling_afresh(), T.fallback_policy("error"), pytest.raises(Exception, match="policy is 'error'"):
            torch.compile(lambda x, w: T.rms_norm(x, (8,), w), fullgraph=True, backend="aot_eager")(x, w)
    else:
        assert stats["fallback"] == {FP64_REASON: 2}  # counted per call, not per trace
        with T.fallback_policy("error"), pytest.raises(T.FallbackError):
            f(x, w)


def test_cpu_without_interpreter_falls_back():
    code = (
        "import os, warnings; os.environ.pop('TRITON_INTERPRET', None)\n"
        "import torch, torch_rmsnorm_op as T\n"
        "x = torch.randn(2, 8)\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always'); T.rms_norm(x, (8,))\n"
        "print(T.dispatch_stats()['fallback'], len(w))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "cpu tensor without the Triton interpreter" in out and out.strip().endswith("1")


def test_torch_logs_shows_fallbacks():
    code = (
        "import torch, torch_rmsnorm_op as T\n"
        "T.set_fallback_policy('reference')\n"
        "T.rms_norm(torch.randn(2, 8, dtype=torch.float64), (8,))\n"
    )
    env = dict(__import__("os").environ, TORCH_LOGS="+torch_rmsnorm_op")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert "rmsnorm.fwd: PyTorch reference fallback (x dtype torch.float64" in out.stderr or \
        "rmsnorm.fwd: PyTorch reference fallback (cpu tensor" in out.stderr, out.stderr


def test_split_mode_needs_resident_programs_and_nvidia(monkeypatch):
    """Split mode's limits on a CUDA device, decided without one: a row's programs must fit on
    the SMs at once, and ROCm gets the fallback (the exchange is PTX)."""
    from torch_rmsnorm_op.config import backward_config

    gpu = torch.device("cuda", 0)
    split_mode_reason = dispatch.split_mode_reason.__wrapped__  # the decision, not its cache
    monkeypatch.setattr(dispatch, "sm_count", lambda device: 132)
    monkeypatch.setattr(torch.version, "hip", None)
    assert split_mode_reason(16384, torch.bfloat16, gpu) is None  # single-pass
    assert split_mode_reason(1 << 20, torch.float32, gpu) is None  # 128 programs per row
    split = backward_config(1 << 20, torch.float32).split
    monkeypatch.setattr(dispatch, "sm_count", lambda device: split - 1)
    assert "more than this GPU's" in split_mode_reason(1 << 20, torch.float32, gpu)
    monkeypatch.setattr(dispatch, "sm_count", lambda device: 132)
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert "NVIDIA PTX" in split_mode_reason(65536, torch.bfloat16, gpu)
    assert split_mode_reason(16384, torch.bfloat16, gpu) is None


def test_compiled_decisions_count_where_a_graph_is_recorded():
    """A decision taken while tracing counts once per call site: in the trace that records the
    graph (make_fx's proxy mode), not in AOTAutograd's metadata pass over the same forward."""
    from torch.fx.experimental.proxy_tensor import make_fx

    fallback.record_kernel("rmsnorm.fwd", compiled=True)  # no graph being recorded
    assert T.dispatch_stats()["compiled"] == {}

    def f(x):
        fallback.record_kernel("rmsnorm.fwd", compiled=True)
        return x + 1

    make_fx(f)(torch.randn(3))
    assert T.dispatch_stats()["compiled"] == {"rmsnorm.fwd: kernel": 1}
