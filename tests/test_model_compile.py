"""A patched model under torch.compile: graphs, dynamic shapes, recompiles, a training step."""

import copy
import functools
import os
import subprocess
import sys
import zipfile

import pytest
import torch
from tolerances import MODEL
from torch._dynamo.testing import CompileCounterWithBackend
from torch.testing import FileCheck

import torch_rmsnorm_op as T
from torch_rmsnorm_op.tools.toy_models import TinyLlama


def _models(device, seed=0):
    torch.manual_seed(seed)
    stock = TinyLlama().to(device)
    with torch.no_grad():
        for m in stock.modules():
            if isinstance(m, torch.nn.RMSNorm):
                m.weight.uniform_(0.5, 1.5)
    patched = copy.deepcopy(stock)
    assert len(T.patch_rmsnorm(patched).swapped) == 5
    return stock, patched


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_patched_model_matches_stock(device, backend, dynamic):
    torch._dynamo.reset()
    stock, patched = _models(device)
    tokens = torch.randint(0, 256, (2, 16), device=device)
    assert torch._dynamo.explain(patched)(tokens).graph_break_count == 0
    compiled = torch.compile(patched, backend=backend, fullgraph=True, dynamic=dynamic)
    T.reset_dispatch_stats()
    out = compiled(tokens)
    if device.type == "cuda":  # the graph launches the kernels: decided once per call site, while tracing
        # The training graph's backward is traced with its forward: its call sites are decided too.
        # Inductor: the first norm, which reads the embeddings, is Inductor's, both directions; the
        # next, of the embeddings plus the attention's output, has Inductor's forward and our backward.
        fused = {"rmsnorm.add_fwd: kernel": 3, "rmsnorm.add_bwd: kernel": 4}
        want = fused if backend == "inductor" else {"rmsnorm.fwd: kernel": 5, "rmsnorm.bwd: kernel": 5}
        # With dynamic shapes AOTAutograd specializes N (the launches depend on it), and Dynamo
        # compiles the frame again with that guard: each call site is traced, and counted, twice.
        traces = 2 if dynamic else 1
        assert T.dispatch_stats()["compiled"] == {k: v * traces for k, v in want.items()}
    elif backend == "inductor":  # one opaque call per norm whose forward is ours, its residual add in it
        assert T.dispatch_stats()["kernel"] == {"rmsnorm.add_fwd": 3}
    else:  # aot_eager runs no Inductor pass: no fused add
        assert T.dispatch_stats()["kernel"] == {"rmsnorm.fwd": 5}
    torch.testing.assert_close(out, stock(tokens), **MODEL[torch.float32])


def test_mark_dynamic_no_recompiles_across_batch_sizes(device):
    torch._dynamo.reset()
    _, patched = _models(device)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(patched, backend=counter, fullgraph=True)
    for batch in (2, 3, 5, 8):
        tokens = torch.randint(0, 256, (batch, 16), device=device)
        torch._dynamo.mark_dynamic(tokens, 0)
        compiled(tokens).sum().backward()
    assert counter.frame_count == 1


def test_compiled_training_step_matches_eager_stock(device):
    """Three SGD steps of the compiled patched model against the eager stock one (fp32): the
    gradients of each step, then the parameters."""
    torch._dynamo.reset()
    stock, patched = _models(device)
    opt_stock = torch.optim.SGD(stock.parameters(), lr=1e-2)
    opt_patched = torch.optim.SGD(patched.parameters(), lr=1e-2)
    compiled = torch.compile(patched, fullgraph=True)
    for step in range(3):
        tokens = torch.randint(0, 256, (2, 16), device=device, generator=torch.Generator(device).manual_seed(step))
        for model, opt in ((stock, opt_stock), (compiled, opt_patched)):
            opt.zero_grad()
            logits = model(tokens[:, :-1])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        for (name, a), b in zip(stock.named_parameters(), patched.parameters()):
            torch.testing.assert_close(b.grad, a.grad, **MODEL[torch.float32], msg=f"step {step} grad {name}")
        opt_stock.step()
        opt_patched.step()
    for (name, a), b in zip(stock.named_parameters(), patched.parameters()):
        torch.testing.assert_close(b, a, **MODEL[torch.float32], msg=name)


class _Checkpointed(torch.nn.Module):
    """A block run under non-reentrant activation checkpointing, with a selective policy's
    ``context_fn`` or none (every op of the block recomputed in the backward)."""

    def __init__(self, block: torch.nn.Module, context_fn=None) -> None:
        super().__init__()
        self.block, self.context_fn = block, context_fn

    def forward(self, x):
        kwargs = {} if self.context_fn is None else {"context_fn": self.context_fn}
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False, **kwargs)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
@pytest.mark.parametrize("policy", ["whole", "saving_norms"])
def test_activation_checkpointing_matches_stock(device, compiled, policy):
    """Each block under activation checkpointing: whole, or selective with a policy that saves
    the outputs of the matmuls and of our ops and recomputes the rest. Outputs and every
    gradient against the stock model without checkpointing, eager and compiled with Inductor
    (no graph break). The policy sees our ops by name (under Inductor the residual rewrite's
    ``rmsnorm.add_fwd`` too), and what it saves the backward does not compute again. Inside a
    checkpointed block the compile rule decides as elsewhere; an add at the end of one block and
    the norm at the start of the next stay apart (fusing them would move the add across the
    checkpoint's boundary), so the block's input norm reads the block's input, which its residual
    add reads too: Inductor's, both directions."""
    torch._dynamo.reset()
    stock, patched = _models(device)
    seen = set()

    def save_norms(ctx, op, *args, **kwargs):
        seen.add(str(op))
        ours = str(op).startswith("rmsnorm.")
        save = ours or op is torch.ops.aten.mm.default
        return torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE if save else \
            torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE

    context_fn = None
    if policy == "saving_norms":
        context_fn = functools.partial(torch.utils.checkpoint.create_selective_checkpoint_contexts, save_norms)
    for i, block in enumerate(patched.blocks):
        patched.blocks[i] = _Checkpointed(block, context_fn)
    tokens = torch.randint(0, 256, (2, 16), device=device)
    want = stock(tokens)
    want.square().mean().backward()
    model = torch.compile(patched, fullgraph=True) if compiled else patched
    T.reset_dispatch_stats()
    got = model(tokens)
    got.square().mean().backward()

    torch.testing.assert_close(got, want, **MODEL[torch.float32])
    for (name, a), b in zip(stock.named_parameters(), patched.parameters()):
        torch.testing.assert_close(b.grad, a.grad, **MODEL[torch.float32], msg=name)
    if policy == "saving_norms":
        assert seen >= ({"rmsnorm.add_fwd.default"} if compiled else {"rmsnorm.fwd.default"})
    # Two blocks of two norms, then the final norm outside them; the forward ops a whole
    # checkpoint runs again in the backward are the blocks' four.
    again = 4 if policy == "whole" else 0
    if not compiled:
        assert T.dispatch_stats()["kernel"] == {"rmsnorm.fwd": 5 + again, "rmsnorm.bwd": 5}
    elif device.type == "cpu":  # the interpreter's graph calls each op, counted per call
        # Per block the MLP's norm takes the attention's residual add, the block's input norm is
        # Inductor's; the final norm, of the last block's output, stays rmsnorm.fwd.
        assert T.dispatch_stats()["kernel"] == {"rmsnorm.fwd": 1, "rmsnorm.add_fwd": 2 + again // 2,
                                                "rmsnorm.bwd": 1, "rmsnorm.add_bwd": 2}


@pytest.mark.cuda
def test_reduce_overhead_has_no_cudagraph_skips():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    stock, patched = _models("cuda")
    compiled = torch.compile(patched, mode="reduce-overhead", fullgraph=True)
    tokens = torch.randint(0, 256, (4, 32), device="cuda")
    with torch.no_grad():
        for _ in range(4):
            out = compiled(tokens)
    assert counters["inductor"]["cudagraph_skips"] == 0
    torch.testing.assert_close(out, stock(tokens), **MODEL[torch.float32])


def _run_package(code: str, env: dict | None = None) -> None:
    """Run ``code``, which loads an AOTInductor package and checks what it computes, in a
    subprocess: it must succeed, or, where ``aoti_load_package`` crashes the process (where it
    does, it does for a plain Linear + ReLU model too), the test is an expected failure, the
    package having been compiled and inspected before."""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    print(f"aoti load-and-run: rc={run.returncode}\n{run.stdout}\n{run.stderr[-2000:]}")
    if run.returncode < 0:
        pytest.xfail(f"aoti_load_package crashed the subprocess (signal {-run.returncode}); the package compiled "
                     "and was inspected")
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.mark.cuda
def test_export_and_aoti_package(tmp_path):
    _, patched = _models("cuda")
    tokens = torch.randint(0, 256, (2, 16), device="cuda")
    ep = torch.export.export(patched, (tokens,))
    assert "torch.ops.rmsnorm.fwd.default" in ep.graph_module.code
    torch.testing.assert_close(ep.module()(tokens), patched(tokens))
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "model.pt2"))
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        text = "".join(z.read(n).decode(errors="ignore") for n in names if n.endswith((".cpp", ".json", ".py")))
    # The package carries our kernel (its binary and its launch), and no call back into Python
    # (AOTInductor calls a Python op through its proxy executor).
    assert any(n.endswith(".cubin") for n in names), names
    FileCheck().check("_rms_norm_fwd_rows").run(text)
    assert "aoti_torch_proxy_executor_call_function" not in text
    torch.save(tokens.cpu(), tmp_path / "tokens.pt")
    torch.save(patched(tokens).detach().cpu(), tmp_path / "want.pt")
    code = (
        "import sys, torch, torch_rmsnorm_op\n"
        f"m = torch._inductor.aoti_load_package({path!r})\n"
        f"out = m(torch.load({str(tmp_path / 'tokens.pt')!r}).cuda())\n"
        f"torch.testing.assert_close(out.cpu(), torch.load({str(tmp_path / 'want.pt')!r}), **{MODEL[torch.float32]!r})\n"
        "print('AOTI package ran and matched')\n"
    )
    _run_package(code, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))


def test_cpu_aoti_package_computes_the_norms_without_python(tmp_path):
    """A CPU package cannot carry the Triton kernels (the interpreter runs in Python): the ops
    take the reference there, a counted fallback, which Inductor compiles into the package's
    C++. The package calls no op of ours and runs in a process that never imports the library."""
    torch.manual_seed(0)
    model = TinyLlama().eval()
    T.patch_rmsnorm(model)
    tokens = torch.randint(0, 256, (2, 16))
    ep = torch.export.export(model, (tokens,))
    assert "torch.ops.rmsnorm.fwd.default" in ep.graph_module.code
    T.reset_dispatch_stats()
    with T.fallback_policy("reference"):
        path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "model.pt2"))
    reason = T.dispatch.AOT_CPU_REASON
    # the norms whose forward the compile rule gives our kernels (the three after a residual add of
    # stored tensors) take the reference; the other two are Inductor's own in any package
    assert T.dispatch_stats()["compiled"] == {f"rmsnorm.add_fwd: reference ({reason})": 3}
    with zipfile.ZipFile(path) as z:
        text = "".join(z.read(n).decode(errors="ignore") for n in z.namelist() if n.endswith((".cpp", ".json")))
    assert "rmsnorm" not in text and "aoti_torch_proxy_executor_call_function" not in text
    with torch.no_grad():
        torch.save((tokens, model(tokens)), tmp_path / "io.pt")
    code = (  # no torch_rmsnorm_op here: the package needs none of it
        "import sys, torch\n"
        f"tokens, want = torch.load({str(tmp_path / 'io.pt')!r})\n"
        f"out = torch._inductor.aoti_load_package({path!r})(tokens)\n"
        f"torch.testing.assert_close(out, want, **{MODEL[torch.float32]!r})\n"
        "assert 'torch_rmsnorm_op' not in sys.modules\n"
    )
    _run_package(code)


def test_cpu_aoti_package_under_the_error_policy_raises():
    """The CPU package's reference is a fallback like any other: ``"error"`` refuses it."""
    torch.manual_seed(0)
    model = TinyLlama().eval()
    T.patch_rmsnorm(model)
    ep = torch.export.export(model, (torch.randint(0, 256, (2, 16)),))
    with T.fallback_policy("error"), pytest.raises(T.FallbackError, match="AOTInductor package"):
        torch._inductor.aoti_compile_and_package(ep)
