"""Every kernel strategy (rows, looped, split) with every feature (weight and its offset, the
rounding before the weight, the fused residual add, multi-stride rows), against the reference.

The launchers run with a forced configuration so that small shapes reach each strategy; the
outputs are poisoned (NaN) first, so an unwritten element fails.
"""

import dataclasses

import pytest
import torch
import triton
import triton.language as tl
from tolerances import TOL, few_roundings

from torch_rmsnorm_op import dispatch, launch, reference
from torch_rmsnorm_op.config import KernelConfig
from torch_rmsnorm_op.kernels.common import _bf16_exact
from torch_rmsnorm_op.layout import row_layout

EPS = 1e-6

FORWARD = {
    "rows": KernelConfig(64, 4, 2),
    "rows-unmasked": KernelConfig(64, 4, 2, mask_free=True),
    "rows-early-weight": KernelConfig(64, 1, 2, early_weight=True),
    "looped": KernelConfig(16, 1, 4, looped=True),
    "looped-unmasked": KernelConfig(16, 1, 4, looped=True, mask_free=True),
    "split": KernelConfig(16, 1, 4, split=4, programs_per_sm=1, stages=2, interleave=True),
}
BACKWARD = {
    "rows": KernelConfig(64, 2, 4, programs_per_sm=1),
    "rows-counted-reload": KernelConfig(64, 2, 4, programs_per_sm=2, counted_loop=True, reload=True),
    "rows-prefetch": KernelConfig(64, 2, 4, programs_per_sm=1, prefetch=True),
    "split": KernelConfig(16, 1, 4, split=4, stages=2, interleave=True),
}


def _input(kind: str, m: int, n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """x of shape [..., n] with ``m`` rows: contiguous, row-strided, or a transposed head view."""
    if kind == "contiguous":
        return torch.randn(m, n, dtype=dtype, device=device)
    if kind == "row-strided":
        return torch.randn(m, n + 5, dtype=dtype, device=device)[:, :n]
    assert kind == "transposed" and m % 6 == 0
    return torch.randn(2, m // 6, 3, n, dtype=dtype, device=device).transpose(1, 2)  # (2, 3, m/6, n)


def _poison(shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _forward(strategy, x, w, r, offset, norm_dtype):
    plan = dispatch.forward_plan(x, w, r, norm_dtype=norm_dtype, weight_offset=offset)
    assert not isinstance(plan, str), plan
    plan = dataclasses.replace(plan, cfg=FORWARD[strategy], launcher=None)
    sum_dtype = x.dtype if r is None else torch.promote_types(x.dtype, r.dtype)
    y = _poison(x.shape, sum_dtype, x.device)
    h = None if r is None else _poison(x.shape, sum_dtype, x.device)
    rstd = _poison(x.shape[:-1], torch.float32, x.device)
    launch.forward(plan, x, w, EPS, y, rstd, r, h)
    return y, h, rstd


@pytest.mark.parametrize("strategy", list(FORWARD))
@pytest.mark.parametrize("layout", ["contiguous", "row-strided", "transposed"])
@pytest.mark.parametrize("residual", [False, True])
def test_forward_strategies(device, strategy, layout, residual):
    n = 48 if strategy.endswith("unmasked") else 60
    m = 12 if not strategy.startswith("rows-unmasked") else 12
    dtype = torch.bfloat16
    x = _input(layout, m, n, dtype, device)
    assert row_layout(x).dims == {"contiguous": 1, "row-strided": 1, "transposed": 3}[layout]
    r = torch.randn(x.shape, dtype=torch.float32 if strategy == "split" else dtype, device=device) if residual else None
    w = torch.randn(n, dtype=torch.float32, device=device)
    for offset, norm_dtype in ((0.0, None), (1.0, torch.bfloat16)):
        y, h, rstd = _forward(strategy, x, w, r, offset, norm_dtype)
        if r is None:
            y_ref, rstd_ref = reference.rms_norm_forward(x.double(), w.double(), EPS, offset, norm_dtype)
        else:
            y_ref, h_ref, rstd_ref = reference.add_rms_norm_forward(x, r, w, EPS, offset, norm_dtype)
            assert torch.equal(h, h_ref)  # the sum exactly as torch adds
            y_ref, rstd_ref = reference.rms_norm_forward(h_ref.double(), w.double(), EPS, offset, norm_dtype)
        # A row rounded to a norm_dtype narrower than y: where the kernel's fp32 x * rstd and
        # float64's fall on either side of a rounding boundary, they are one unit of it apart.
        narrower = norm_dtype is not None and norm_dtype.itemsize < y.dtype.itemsize
        tol = few_roundings(norm_dtype) if narrower else TOL[y.dtype]
        torch.testing.assert_close(y.double(), y_ref.to(y.dtype).double(), **tol)
        torch.testing.assert_close(rstd.double(), rstd_ref, **TOL[torch.float32])


@pytest.mark.parametrize("kind", ["plain", "residual", "norm-add"])
def test_forward_bits_do_not_depend_on_where_the_weight_is_loaded(device, kind):
    """``early_weight`` moves the weight's load, not the arithmetic: y, the sum and rstd keep their bits."""
    m, n = 10, 60
    x = torch.randn(m, n, dtype=torch.bfloat16, device=device)
    r = torch.randn(m, n, dtype=torch.bfloat16, device=device)
    w, xw = torch.rand(n, device=device) + 0.5, torch.rand(n, device=device) + 0.5
    outs = []
    for early in (False, True):
        plan = dispatch.forward_plan(x, w, r if kind == "residual" else None, norm_dtype=torch.bfloat16)
        plan = dataclasses.replace(plan, cfg=KernelConfig(64, 2, 2, early_weight=early), launcher=None)
        y, h = _poison(x.shape, x.dtype, device), _poison(x.shape, x.dtype, device)
        rstd, x_rstd = _poison((m,), torch.float32, device), _poison((m,), torch.float32, device)
        if kind == "norm-add":
            launch.forward_norm_add(plan, x, r, xw, w, EPS, EPS, y, h, rstd, x_rstd)
            # The kernel's configuration, kept on the plan, follows a replaced cfg.
            assert plan.norm_add_cfg.early_weight == early
            assert dataclasses.replace(plan, cfg=KernelConfig(64, 2, 2)).norm_add_cfg is None
        else:
            launch.forward(plan, x, w, EPS, y, rstd, r if kind == "residual" else None, h if kind == "residual" else None)
        outs.append((y, h, rstd, x_rstd))
    for late, early in zip(*outs, strict=True):
        assert torch.equal(late, early) or (late.isnan().all() and early.isnan().all())
    assert not outs[0][0].isnan().any()


@pytest.mark.parametrize("strategy", list(BACKWARD))
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("residual_grad", [False, True])
@pytest.mark.parametrize("with_weight", [True, False])
def test_backward_strategies(device, strategy, layout, residual_grad, with_weight):
    n, m = 60, 18
    x = _input(layout, m, n, torch.float32, device)
    w = torch.randn(n, device=device) if with_weight else None
    dy = torch.randn(x.shape, device=device)
    dres = torch.randn(x.shape, device=device) if residual_grad else None
    _, rstd = reference.rms_norm_forward(x, w, EPS)
    plan = dataclasses.replace(dispatch.backward_plan(x, w, dy.dtype, weight_offset=0.5), cfg=BACKWARD[strategy])
    dx = _poison(x.shape, x.dtype, device)
    dw = None if w is None else _poison(w.shape, w.dtype, device)
    launch.backward(plan, dy, x, w, rstd, dx, dw, dres)
    dx_ref, dw_ref = reference.add_rms_norm_backward(dy.double(), None if dres is None else dres.double(),
                                                     x.double(), None if w is None else w.double(), rstd, 0.5)
    torch.testing.assert_close(dx.double(), dx_ref, **TOL[torch.float32])
    if w is not None:
        torch.testing.assert_close(dw.double(), dw_ref, **TOL[torch.float32])


@pytest.mark.parametrize("strategy", ["rows", "split"])
def test_backward_is_bitwise_deterministic(device, strategy):
    x = torch.randn(40, 60, device=device)
    w, dy = torch.randn(60, device=device), torch.randn(40, 60, device=device)
    _, rstd = reference.rms_norm_forward(x, w, EPS)
    plan = dataclasses.replace(dispatch.backward_plan(x, w, dy.dtype), cfg=BACKWARD[strategy])
    outs = []
    for _ in range(2):
        dx, dw = torch.empty_like(x), torch.empty_like(w)
        launch.backward(plan, dy, x, w, rstd, dx, dw)
        outs.append((dx, dw))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("terms", [1, 5])
@pytest.mark.parametrize("counted", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_backward_bits_do_not_depend_on_loading_a_tile_ahead(device, terms, counted, layout):
    """``prefetch`` moves the row loop's loads a tile earlier and changes no arithmetic: dx and
    dweight are the same bits, over row groups whose last tile is partial, with the residual's
    gradient and summed terms, on rows addressed by one stride or by a head view's three."""
    x = _input(layout, 42, 60, torch.bfloat16, device)
    w = torch.randn(60, device=device, dtype=torch.bfloat16)
    dy, *more = (torch.randn(x.shape, device=device, dtype=x.dtype) for _ in range(terms))
    dres = torch.randn(x.shape, device=device, dtype=x.dtype)
    _, rstd = reference.rms_norm_forward(x, w, EPS)
    outs = []
    for prefetch in (False, True):
        cfg = KernelConfig(64, 2, 4, programs_per_sm=1, counted_loop=counted, prefetch=prefetch)
        plan = dataclasses.replace(dispatch.backward_plan(x, w, x.dtype), cfg=cfg)
        dx, dw = _poison(x.shape, x.dtype, device), _poison(w.shape, w.dtype, device)
        launch.backward(plan, dy, x, w, rstd, dx, dw, dres, dy_terms=tuple(more))
        outs.append((dx, dw))
    assert not outs[0][0].isnan().any() and not outs[0][1].isnan().any()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("strategy", ["rows", "rows-2048", "rows-prefetch", "split"])
@pytest.mark.parametrize("terms", [2, 3, 5])
def test_backward_sums_its_gradient_terms(device, strategy, terms):
    """``dy_terms``: the kernel adds the gradient's terms as Inductor's fused sum does (in fp32,
    rounded once to bf16), so dx is the bits of a backward given that sum, with the tile rows
    ``launch.summed_gradient_consts`` gives a compiled launch. dweight is those bits where the
    tiles keep their rows (split); where they hold fewer (rows: 2 → 1), its rows are added in
    another order in fp32 before the one rounding to bf16, which may then differ in the last
    place."""
    x = torch.randn(18, 60, device=device, dtype=torch.bfloat16)
    w = torch.randn(60, device=device, dtype=torch.bfloat16)
    parts = [torch.randn(x.shape, device=device, dtype=x.dtype) for _ in range(terms)]
    total = sum(p.float() for p in parts).to(x.dtype)
    _, rstd = reference.rms_norm_forward(x, w, EPS)
    # rows-2048: a tile width config.BWD_SUMMED names (3 terms: 1 row, the loop prefetching a row ahead)
    cfg = KernelConfig(2048, 2, 8, programs_per_sm=1) if strategy == "rows-2048" else BACKWARD[strategy]
    plan = dataclasses.replace(dispatch.backward_plan(x, w, x.dtype), cfg=cfg)
    outs = []
    for dy, more in ((total, ()), (parts[0], tuple(parts[1:]))):
        dx, dw = _poison(x.shape, x.dtype, device), _poison(w.shape, w.dtype, device)
        launch.backward(plan, dy, x, w, rstd, dx, dw, dy_terms=more)
        outs.append((dx, dw))
    (dx_sum, dw_sum), (dx_terms, dw_terms) = outs
    assert torch.equal(dx_terms, dx_sum)
    if strategy == "split" or (strategy == "rows-2048" and terms == 2):
        assert torch.equal(dw_terms, dw_sum)
    else:
        torch.testing.assert_close(dw_terms, dw_sum, **few_roundings(torch.bfloat16))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_summing_split_backward_fits_in_shared_memory(dtype):
    """The split backward's rung at N = 65,536 (stages 4 in bf16, 3 in fp32) pipelines rows of x,
    of each gradient term and of the residual's gradient through shared memory: a launch that
    sums 2 to 5 terms takes fewer stages (``launch.summed_gradient_consts``) and compiles (with
    the rung's stages, 3 terms in bf16 and 2 in fp32 beside the residual's gradient needed more
    than the 227 KiB an H100 or H200 block has), and dx is the bits of a launch given the
    summed gradient."""
    x = torch.randn(64, 65536, device="cuda", dtype=dtype)
    w = torch.randn(65536, device="cuda", dtype=dtype)
    dres = torch.randn_like(x)
    _, rstd = reference.rms_norm_forward(x, w, EPS)
    plan = dispatch.backward_plan(x, w, dtype)
    assert plan.cfg.split > 1 and plan.cfg.stages > 2, plan.cfg
    for terms in range(2, launch.MAX_DY_TERMS + 1):
        parts = [torch.randn_like(x) for _ in range(terms)]
        total = sum(part.float() for part in parts).to(dtype)
        dxs = []
        for dy, more in ((total, ()), (parts[0], tuple(parts[1:]))):
            dx, dw = _poison(x.shape, dtype, x.device), _poison(w.shape, dtype, x.device)
            launch.backward(plan, dy, x, w, rstd, dx, dw, dres, dy_terms=more)
            dxs.append(dx)
        assert not dxs[1].isnan().any() and torch.equal(dxs[0], dxs[1]), terms


def test_backward_merges_its_dweight_partials_in_pairs(device, monkeypatch):
    """With the scratch thresholds at zero the backward merges its row groups' dweight partials
    in pairs (``kernels.common._merge_partial``): dweight against the reference, the same bits
    from run to run, dx as without merging."""
    x = torch.randn(40, 60, device=device)
    w, dy = torch.randn(60, device=device), torch.randn(40, 60, device=device)
    _, rstd = reference.rms_norm_forward(x, w, EPS)
    plan = dataclasses.replace(dispatch.backward_plan(x, w, dy.dtype), cfg=BACKWARD["rows"])
    dx_alone = torch.empty_like(x)
    launch.backward(plan, dy, x, w, rstd, dx_alone, torch.empty_like(w))
    monkeypatch.setattr(launch, "MERGE_SCRATCH_BYTES", 0)
    monkeypatch.setattr(launch, "MERGE_SCRATCH_SHARE", 0)
    groups, _ = launch.row_groups(40, 60, x.device, plan.cfg)
    assert groups > 2 and launch.merged_partials(groups, 40, 60, x.dtype)
    outs = []
    for _ in range(2):
        dx, dw = _poison(x.shape, x.dtype, device), _poison(w.shape, w.dtype, device)
        launch.backward(plan, dy, x, w, rstd, dx, dw)
        outs.append((dx, dw))
    _, dw_ref = reference.rms_norm_backward(dy.double(), x.double(), w.double(), rstd)
    torch.testing.assert_close(outs[0][1].double(), dw_ref, **TOL[torch.float32])
    assert torch.equal(outs[0][1], outs[1][1]) and torch.equal(outs[0][0], dx_alone)


def test_backward_rejects_unlike_gradient_terms(device):
    x = torch.randn(4, 8, device=device)
    w, dy = torch.randn(8, device=device), torch.randn(4, 8, device=device)
    _, rstd = reference.rms_norm_forward(x, w, EPS)
    plan = dispatch.backward_plan(x, w, dy.dtype)
    dx, dw = torch.empty_like(x), torch.empty_like(w)
    for more in ((dy.double(),), (torch.randn(8, 4, device=device).t(),), (dy,) * launch.MAX_DY_TERMS):
        with pytest.raises(ValueError, match="dy_terms"):
            launch.backward(plan, dy, x, w, rstd, dx, dw, dy_terms=more)


@triton.jit
def _bf16_exact_kernel(X, Y, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    tl.store(Y + offs, _bf16_exact(tl.load(X + offs, mask=mask)), mask=mask)


def test_bf16_exact_rounds_as_a_cast_does(device):
    """``kernels.common._bf16_exact`` (the norm-add kernel's rounding, kept from a following
    add's contraction) against torch's fp32 -> bf16 cast: ties to even both ways, the largest
    finite values, overflow to infinity, subnormals, signed zeros, infinities and NaN."""
    bits = [0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F807FFF, 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0x00008000,
            0x00018000, 0x00000001, 0x807FFFFF, 0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0xFF7FFFFF]
    special = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.cat([special, torch.randn(4096) * 10.0 ** torch.randint(-30, 30, (4096,)).float()]).to(device)
    x = torch.cat([x, torch.tensor([float("nan")], device=device)])
    y = torch.empty_like(x)
    _bf16_exact_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    want = x.to(torch.bfloat16).float()
    assert torch.equal(y[:-1], want[:-1]) and torch.equal(y[:-1].view(torch.int32), want[:-1].view(torch.int32))
    assert y[-1].isnan()


def _language_helper():
    return tl.load


@pytest.mark.skipif(not dispatch.interpreted(), reason="the Triton interpreter's language patching")
def test_interpreter_patches_the_language_once_per_launch():
    """Under the interpreter a launch patches ``triton.language`` and restores it after; a
    ``@triton.jit`` helper called inside the launch finds it patched and patches nothing again
    (``_triton_compat._patch_interpreter_language_once``), outside a launch it patches as before."""
    from triton.runtime import interpreter

    if getattr(interpreter, "_LangPatchScope", None) is None:
        pytest.skip("this Triton's interpreter keeps no patch scope")
    patch_lang = interpreter._patch_lang
    assert tl.core.is_builtin(tl.load)
    launch_scope = patch_lang(_language_helper)  # what a launch does first
    try:
        assert not tl.core.is_builtin(tl.load)
        assert patch_lang(_language_helper)._changes == []  # a helper's call inside the launch
    finally:
        launch_scope.restore()
    assert tl.core.is_builtin(tl.load)
