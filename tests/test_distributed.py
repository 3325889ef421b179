"""The ops and a patched model across two processes, each result equal to one process's:

- DistributedDataParallel and FSDP2 (``fully_shard``) training steps of a patched model;
- the ops on DTensors (replicated, sharded over rows, sharded over the normalized dim);
- a transformers Llama decoder layer under ``parallelize_module`` with torchtitan's tensor and
  sequence parallel plan (``SequenceParallel`` on the norms), its norms patched to the ops.

Over gloo on two CPU processes (the kernels through the Triton interpreter), and over NCCL on
two GPUs (``cuda``-marked, with ``torch.compile`` on the training steps). The workers run the
kernels under the fallback policy ``"error"`` and count their calls: the local shards are
served by the kernels, not by a fallback.
"""

import os
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tolerances import MULTI_GPU, TOL, few_roundings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORLD = 2
BATCH = 4  # global batch, split evenly over the ranks
N = 24  # the ops' normalized width on DTensors
RUN_TIMEOUT_S = 300  # one launch, both processes, start to finish
COLLECTIVE_TIMEOUT = timedelta(seconds=120)  # a rank waiting on a dead peer fails instead of hanging

# Two processes sum gradients in another order than one (all-reduce over ranks, DTensor's
# Partial, local matmuls over half the rows): on CPU within the table's fp32 entry; on GPUs,
# compiled graphs and cuBLAS pick kernels by shape, and the ranks' shapes are half the single
# run's (MULTI_GPU).
RANKS_TOL = {"cpu": TOL[torch.float32], "cuda": MULTI_GPU}
# The ops on DTensors against the same ops on the full tensors in one process: the same kernels
# over the same rows; dweight sums the rows in two parts.
OP_TOL = few_roundings(torch.float32)
BF16_TOL = few_roundings(torch.bfloat16)  # one bf16 rounding apart


def _skip_without(backend: str | None) -> None:
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    if backend == "gloo" and not dist.is_gloo_available():
        pytest.skip("torch.distributed has no gloo backend")
    if backend == "nccl":
        if torch.cuda.device_count() < WORLD:
            pytest.skip("needs two CUDA devices")
        if not dist.is_nccl_available():
            pytest.skip("torch.distributed has no NCCL backend")


def _launch(worker, tmp_path, backend: str, *args) -> None:
    """Run ``worker(rank, init_method, backend, out_dir, *args)`` in WORLD spawned processes.

    Rendezvous through a file in ``tmp_path`` (no port to pick, none to collide). A worker's
    exception fails the test with its traceback; a launch running past RUN_TIMEOUT_S is killed."""
    init_method = f"file://{tmp_path / f'store-{worker.__name__}'}"
    ctx = mp.start_processes(worker, args=(init_method, backend, str(tmp_path), *args), nprocs=WORLD,
                             start_method="spawn", join=False)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join()
            pytest.fail(f"{worker.__name__} over {backend} did not finish within {RUN_TIMEOUT_S} s")


@pytest.fixture
def nccl_env(monkeypatch):
    """The workers' environment on GPUs: NVLink SHARP (multicast) stays off."""
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")


def _init(rank: int, init_method: str, backend: str) -> torch.device:
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device = torch.device("cpu")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=WORLD,
                            timeout=COLLECTIVE_TIMEOUT, **({"device_id": device} if backend == "nccl" else {}))
    return device


def _finish() -> None:
    """Leave the process group, then the process."""
    try:
        dist.barrier()  # neither rank tears the group down while the other is still in a collective
    finally:
        dist.destroy_process_group()
    # A worker still died now and then with "terminate called without an active exception"
    # (SIGABRT) after all of the above, during interpreter shutdown, where threads left behind
    # by the process group meet static destructors (pytorch/pytorch#179291 describes the same
    # at finalization). Everything this worker owes the test is written: leave without
    # finalization. Failures before this line raise and still report through spawn.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _kernel_calls() -> dict[str, int]:
    """Calls served by the kernels since the last reset, call sites of compiled graphs that launch
    them included (counted once, while tracing, where the graph holds the launch); no fallback."""
    import torch_rmsnorm_op as T

    stats = T.dispatch_stats()
    assert stats["fallback"] == {}, stats
    calls = dict(stats["kernel"])
    for site, n in stats.get("compiled", {}).items():
        op, _, decision = site.partition(": ")
        assert decision == "kernel", stats
        calls[op] = calls.get(op, 0) + n
    return calls


# --- DistributedDataParallel and FSDP2 -----------------------------------------------------------


def _model(device: torch.device, compiled: bool):
    import torch_rmsnorm_op as T
    from torch_rmsnorm_op.tools.toy_models import TinyLlama

    torch.manual_seed(0)
    model = TinyLlama(vocab=64, dim=32, depth=1, heads=2).to(device)
    assert len(T.patch_rmsnorm(model).swapped) == 3
    if compiled:  # as torchtitan does: each block compiled whole, then wrapped
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, fullgraph=True)
    return model


def _loss(model, tokens):
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _tokens(device: torch.device):
    return torch.randint(0, 64, (BATCH, 9), generator=torch.Generator().manual_seed(1)).to(device)


def _grads(model) -> dict[str, torch.Tensor]:
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad  # FSDP2: DTensor shards
        grads[name.replace("_orig_mod.", "")] = g.detach().cpu().clone()
    return grads


def _train_worker(rank, init_method, backend, out_dir, mode, compiled):
    device = _init(rank, init_method, backend)
    import torch_rmsnorm_op as T

    model = _model(device, compiled)
    T.reset_dispatch_stats()  # the patcher's probes ran the forward too
    if mode == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (WORLD,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
    with T.fallback_policy("error"):
        _loss(wrapped, _tokens(device).chunk(WORLD)[rank]).backward()
    # Three norms, each forward and backward once. A compiled graph's call sites may be counted
    # once per trace rather than per call, so there at least three.
    calls = _kernel_calls()
    if compiled:
        assert calls.keys() == {"rmsnorm.fwd", "rmsnorm.bwd"} and min(calls.values()) >= 3, calls
    else:
        assert calls == {"rmsnorm.fwd": 3, "rmsnorm.bwd": 3}, calls
    grads = _grads(model)
    if rank == 0:
        torch.save(grads, os.path.join(out_dir, f"{mode}.pt"))
    _finish()


def _check_training(tmp_path, backend: str, mode: str, compiled: bool) -> None:
    _launch(_train_worker, tmp_path, backend, mode, compiled)
    got = torch.load(tmp_path / f"{mode}.pt")
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    model = _model(device, compiled)
    _loss(model, _tokens(device)).backward()  # the mean over the global batch = the mean of the ranks' means
    want = _grads(model)
    assert got.keys() == want.keys()
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, **RANKS_TOL[device.type], msg=name)


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_distributed_gradients_match_single_process(tmp_path, mode):
    _skip_without("gloo")
    _check_training(tmp_path, "gloo", mode, compiled=False)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_compiled_distributed_gradients_match_single_gpu_on_two_gpus(tmp_path, nccl_env, mode):
    _skip_without("nccl")
    _check_training(tmp_path, "nccl", mode, compiled=True)


# --- Registration -------------------------------------------------------------------------------

_REGISTRATION_CHECK = """
import sys
import torch_rmsnorm_op as T
{before}
assert T.distributed.sharding_rules_registered() == {registered_before}, "before"
{after}
assert T.distributed.sharding_rules_registered(), "after"
assert T.distributed._finder not in sys.meta_path
"""


def test_sharding_rules_register_when_dtensor_is_imported():
    """Each case in a fresh interpreter (run side by side); a failed registration warns with a
    RuntimeWarning, turned into an error here."""
    _skip_without(None)
    cases = {
        # DTensor imported after the package (not by it), here inside another package's import
        # (FSDP2's, whose modules are half initialized then): registered by that import
        "later": ("assert 'torch.distributed.tensor' not in sys.modules", False,
                  "from torch.distributed.fsdp import fully_shard"),
        # DTensor imported first: registered on the package's import
        "dtensor-first": ("", True, ""),
    }
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = {}
    for name, (before, registered_before, after) in cases.items():
        code = _REGISTRATION_CHECK.format(before=before, registered_before=registered_before, after=after)
        if name == "dtensor-first":
            code = "import torch.distributed.tensor\n" + code
        runs[name] = subprocess.Popen([sys.executable, "-W", "error::RuntimeWarning", "-c", code], cwd=root,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for name, run in runs.items():
        try:
            _, err = run.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            run.kill()
            run.communicate()
            pytest.fail(f"{name}: did not finish within 120 s")
        assert run.returncode == 0, f"{name}: {err}"


# --- The ops on DTensors -------------------------------------------------------------------------


def _dtensor_ops_worker(rank, init_method, backend, out_dir):
    device = _init(rank, init_method, backend)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    import torch_rmsnorm_op as T

    assert T.distributed.sharding_rules_registered()
    mesh = init_device_mesh(device.type, (WORLD,))
    g = torch.Generator().manual_seed(0)
    # 5 rows on dim 1: uneven shards (3 and 2)
    x, dy, r = (torch.randn(4, 5, N, generator=g).to(device) for _ in range(3))
    w = (torch.rand(N, generator=g) + 0.5).to(device)

    def one_process(fn, *tensors):
        """fn on plain copies of the full tensors: its outputs and its inputs' gradients."""
        leaves = [None if t is None else t.detach().clone().requires_grad_() for t in tensors]
        return fn(*leaves), leaves

    def check(name, got, want):
        torch.testing.assert_close(got.full_tensor(), want, **OP_TOL, msg=name)

    rows = [Replicate(), Shard(0), Shard(1)]
    for placement in [*rows, Shard(2)]:  # Shard(2): the normalized dim
        for with_weight in (True, False):
            case = f"{placement}, weight={with_weight}"
            xd = distribute_tensor(x, mesh, [placement]).requires_grad_()
            wd = distribute_tensor(w, mesh, [Replicate()]).requires_grad_() if with_weight else None
            T.reset_dispatch_stats()
            with T.fallback_policy("error"):
                y = T.rms_norm(xd, (N,), wd)
                y.backward(distribute_tensor(dy, mesh, [placement]))
            assert _kernel_calls() == {"rmsnorm.fwd": 1, "rmsnorm.bwd": 1}, case
            if placement in rows:  # the kernels ran on the local shards: nothing was redistributed
                assert y.placements == (placement,) and xd.grad.placements == (placement,), case
            else:
                assert Shard(2) not in y.placements, case
            (want_y, leaves) = one_process(lambda a, b: T.rms_norm(a, (N,), b), x, w if with_weight else None)
            want_y.backward(dy)
            check(f"y, {case}", y, want_y)
            check(f"dx, {case}", xd.grad, leaves[0].grad)
            if with_weight:
                # a sum over the local rows: complete only where every rank holds every row
                assert wd.grad.placements == ((Replicate(),) if y.placements == (Replicate(),) else (Partial(),)), case
                check(f"dweight, {case}", wd.grad, leaves[1].grad)

    # The op itself: rstd keeps x's placement; a weight that is not replicated is redistributed.
    xd = distribute_tensor(x, mesh, [Shard(1)])
    y, rstd = torch.ops.rmsnorm.fwd(xd, distribute_tensor(w, mesh, [Shard(0)]), 1e-6)
    want_y, want_rstd = torch.ops.rmsnorm.fwd(x, w, 1e-6)
    assert rstd.placements == (Shard(1),)
    check("op y", y, want_y)
    check("op rstd", rstd, want_rstd)

    # Keyword-only arguments reach the local calls (the reference serves them today).
    kw = {"weight_offset": 1.0, "norm_dtype": torch.bfloat16, "out_dtype": torch.bfloat16}
    with T.fallback_policy("reference"):
        y = T.rms_norm(xd, (N,), distribute_tensor(w, mesh, [Replicate()]), **kw)
    assert y.dtype == torch.bfloat16 and y.placements == (Shard(1),)
    torch.testing.assert_close(y.full_tensor(), T.rms_norm(x, (N,), w, **kw), **BF16_TOL)

    # Residual add + norm, both outputs' gradients, rows sharded.
    xd, rd = (distribute_tensor(t, mesh, [Shard(1)]).requires_grad_() for t in (x, r))
    wd = distribute_tensor(w, mesh, [Replicate()]).requires_grad_()
    yd, sd = T.add_rms_norm(xd, rd, (N,), wd)
    assert yd.placements == sd.placements == (Shard(1),)
    torch.autograd.backward((yd, sd), (distribute_tensor(dy, mesh, [Shard(1)]), distribute_tensor(r, mesh, [Shard(1)])))
    (want_y, want_s), leaves = one_process(lambda a, b, c: T.add_rms_norm(a, b, (N,), c), x, r, w)
    torch.autograd.backward((want_y, want_s), (dy, r))
    for name, got, want in (("y", yd, want_y), ("residual_out", sd, want_s), ("dx", xd.grad, leaves[0].grad),
                            ("dresidual", rd.grad, leaves[1].grad), ("dweight", wd.grad, leaves[2].grad)):
        check(f"add_rms_norm {name}", got, want)
    assert wd.grad.placements == (Partial(),)

    # Norm, residual add, norm (Gemma's), rows sharded: the outputs keep the rows' placement.
    xd, rd = (distribute_tensor(t, mesh, [Shard(1)]).requires_grad_() for t in (x, r))
    xwd, wd = (distribute_tensor(t, mesh, [Replicate()]).requires_grad_() for t in (w, w.flip(0)))
    outs = torch.ops.rmsnorm.norm_add_fwd(xd, rd, xwd, 1e-6, wd, 1e-5, weight_offset=1.0)
    assert all(t.placements == (Shard(1),) for t in outs)
    torch.autograd.backward(outs[:2], (distribute_tensor(dy, mesh, [Shard(1)]), distribute_tensor(r, mesh, [Shard(1)])))
    want, leaves = one_process(lambda a, b, c, d: torch.ops.rmsnorm.norm_add_fwd(a, b, c, 1e-6, d, 1e-5,
                                                                                 weight_offset=1.0), x, r, w, w.flip(0))
    torch.autograd.backward(want[:2], (dy, r))
    for name, got, expected in zip(("y", "residual_out", "rstd", "x_rstd"), outs, want):
        check(f"norm_add_fwd {name}", got, expected)
    for name, got, leaf in zip(("dx", "dresidual", "dx_weight", "dweight"), (xd, rd, xwd, wd), leaves):
        check(f"norm_add_fwd {name}", got.grad, leaf.grad)
    _finish()


def test_ops_on_dtensors_match_single_process(tmp_path):
    _skip_without("gloo")
    _launch(_dtensor_ops_worker, tmp_path, "gloo")


@pytest.mark.cuda
def test_ops_on_dtensors_match_single_gpu_on_two_gpus(tmp_path, nccl_env):
    _skip_without("nccl")
    _launch(_dtensor_ops_worker, tmp_path, "nccl")


# --- Tensor and sequence parallel: a Llama decoder layer ------------------------------------------

SEQ = 6  # sharded over the ranks by SequenceParallel


def _llama_layer(device: torch.device):
    """A transformers LlamaDecoderLayer from a tiny config, norms patched, and its rotary embedding."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    import torch_rmsnorm_op as T

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, num_hidden_layers=1, vocab_size=64, max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(config, layer_idx=0)
    with torch.no_grad():  # norms away from their all-ones init, so that their gradients are tested
        layer.input_layernorm.weight.uniform_(0.5, 1.5)
        layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
    assert len(T.patch_rmsnorm(layer).swapped) == 2
    return layer.to(device), LlamaRotaryEmbedding(config).to(device)


def _layer_inputs(device: torch.device):
    g = torch.Generator().manual_seed(2)
    return torch.randn(2, SEQ, 32, generator=g).to(device), torch.randn(2, SEQ, 32, generator=g).to(device)


def _run_layer(layer, rotary, x, grad_out):
    positions = torch.arange(SEQ, device=x.device).unsqueeze(0)
    out = layer(x, position_embeddings=rotary(x, positions))  # the full sequence's positions on every rank
    out.backward(grad_out)
    return out


def _tp_plan():
    """torchtitan's Llama plan on transformers' module names: sequence parallel norms, column-wise
    q/k/v and gate/up, row-wise o and down back to sequence shards."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    return {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                        desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }


def _tensor_parallel_worker(rank, init_method, backend, out_dir):
    device = _init(rank, init_method, backend)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    import torch_rmsnorm_op as T

    layer, rotary = _llama_layer(device)
    parallelize_module(layer, init_device_mesh(device.type, (WORLD,)), _tp_plan())
    assert isinstance(layer.input_layernorm.weight, DTensor)
    # this rank's sequence shard, in memory of its own as a rank's activations are
    x, grad_out = (t.chunk(WORLD, dim=1)[rank].contiguous() for t in _layer_inputs(device))
    x.requires_grad_()
    T.reset_dispatch_stats()
    with T.fallback_policy("error"):
        out = _run_layer(layer, rotary, x, grad_out)
    # Each norm ran forward and backward once, on this rank's rows, through the kernels.
    assert _kernel_calls() == {"rmsnorm.fwd": 2, "rmsnorm.bwd": 2}
    grads = {name: p.grad.full_tensor().cpu() for name, p in layer.named_parameters()}  # collectives: every rank
    torch.save({"out": out.detach().cpu(), "dx": x.grad.cpu()}, os.path.join(out_dir, f"shard{rank}.pt"))
    if rank == 0:
        torch.save(grads, os.path.join(out_dir, "grads.pt"))
    _finish()


def _check_tensor_parallel(tmp_path, backend: str) -> None:
    _launch(_tensor_parallel_worker, tmp_path, backend)
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    layer, rotary = _llama_layer(device)
    x, grad_out = _layer_inputs(device)
    x.requires_grad_()
    out = _run_layer(layer, rotary, x, grad_out)
    shards = [torch.load(tmp_path / f"shard{r}.pt") for r in range(WORLD)]
    tol = RANKS_TOL[device.type]
    torch.testing.assert_close(torch.cat([s["out"] for s in shards], dim=1), out.detach().cpu(), **tol, msg="output")
    torch.testing.assert_close(torch.cat([s["dx"] for s in shards], dim=1), x.grad.cpu(), **tol, msg="input grad")
    got = torch.load(tmp_path / "grads.pt")
    assert got.keys() == dict(layer.named_parameters()).keys()
    for name, p in layer.named_parameters():
        torch.testing.assert_close(got[name], p.grad.cpu(), **tol, msg=name)


def test_llama_layer_tensor_and_sequence_parallel_matches_single_process(tmp_path):
    _skip_without("gloo")
    _check_tensor_parallel(tmp_path, "gloo")


@pytest.mark.cuda
def test_llama_layer_tensor_and_sequence_parallel_on_two_gpus(tmp_path, nccl_env):
    _skip_without("nccl")
    _check_tensor_parallel(tmp_path, "nccl")
