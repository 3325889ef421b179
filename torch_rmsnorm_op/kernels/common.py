"""``@triton.jit`` helpers the strategies share: row addressing, the residual sum, the
normalization with its weight, the backward's row dot product."""

import triton
import triton.language as tl


@triton.jit
def _rstd(sum_sq, n, eps):
    """``1 / sqrt(sum_sq / n + eps)`` in fp32. Triton's launcher passes a Python float as fp32,
    but Inductor's generated code passes it as fp64; uncast, eps would carry the row's whole
    normalization into fp64 (rsqrt, the products, their conversions) in compiled graphs only."""
    return tl.rsqrt(sum_sq / n + tl.cast(eps, tl.float32))


@triton.jit
def _row_offset(row, size1, size2, stride0, stride1, stride2, LEAD_DIMS: tl.constexpr):
    """Offset of row ``row`` (int64, scalar or vector) of a tensor whose leading dims, merged
    where their strides allow, are ``LEAD_DIMS`` (1 to 3) dims of sizes ``(*, size1, size2)``
    and strides ``(stride0, stride1, stride2)``: a single row stride, or e.g. the
    ``(B, H, S, D)`` transposed view of a ``(B, S, H, D)`` tensor, read with no copy."""
    if LEAD_DIMS == 1:
        return row * stride0
    elif LEAD_DIMS == 2:
        return (row // size1) * stride0 + (row % size1) * stride1
    else:
        return (row // (size1 * size2)) * stride0 + ((row // size2) % size1) * stride1 + (row % size2) * stride2


@triton.jit
def _residual_sum(x, r, SUM_TY: tl.constexpr):
    """``x + r`` as torch adds them: in fp32, rounded to the sum's dtype; returned in that dtype."""
    return (x.to(tl.float32) + r.to(tl.float32)).to(SUM_TY)


@triton.jit
def _round(y, ROUND: tl.constexpr):
    """``y`` (fp32) rounded to fp16 (``ROUND`` 1) or bf16 (2) and back; 0 leaves it."""
    if ROUND == 1:
        y = y.to(tl.float16).to(tl.float32)
    elif ROUND == 2:
        y = y.to(tl.bfloat16).to(tl.float32)
    return y


@triton.jit
def _bf16_exact(y):
    """``y`` (fp32) rounded to the nearest bf16 (ties to even) as ``y.to(tl.bfloat16)`` rounds it,
    returned as fp32, by integer operations on its bits. An add that follows sees an fp32 value of
    unknown origin: after a cast, the compiler turns an fp32 product of two bf16 values (exact)
    rounded to bf16 into a bf16 multiply, which a bf16 add then joins into one fused multiply-add
    that rounds once, where two kernels, the product stored between them, round twice."""
    bits = y.to(tl.uint32, bitcast=True)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return tl.where(y != y, y, bits.to(tl.float32, bitcast=True))


@triton.jit
def _weight(w, WEIGHT_OFFSET: tl.constexpr):
    """The weight as it scales the row: ``w + WEIGHT_OFFSET`` in fp32 (``1 + w`` where the offset is 1)."""
    w = w.to(tl.float32)
    if WEIGHT_OFFSET != 0.0:
        w = w + WEIGHT_OFFSET
    return w


@triton.jit
def _scale(x, rstd, w, HAS_WEIGHT: tl.constexpr, ROUND: tl.constexpr):
    """y in fp32: ``round(x * rstd) * w`` (``w`` from ``_weight``, broadcast by the caller)."""
    y = _round(x * rstd, ROUND)
    if HAS_WEIGHT:
        y = y * w
    return y


@triton.jit
def _sum_sq(x):
    """Sum of squares in fp32."""
    x = x.to(tl.float32)
    return tl.sum(x * x, axis=0)


@triton.jit
def _dot(x, dy, w, HAS_WEIGHT: tl.constexpr):
    """This chunk's part of the row's sum of dy * w * x (fp32; ``w`` fp32, unused without a weight)."""
    u = dy.to(tl.float32)
    if HAS_WEIGHT:
        u = u * w
    return tl.sum(u * x.to(tl.float32), axis=0)


@triton.jit
def _load_f32(ptrs, mask, POLICY: tl.constexpr):
    """Masked load (0 where masked) as fp32, with a cache eviction policy ("" for none)."""
    return tl.load(ptrs, mask=mask, other=0.0, eviction_policy=POLICY).to(tl.float32)


@triton.jit
def _load_dy(DY, DY2, DY3, DY4, DY5, offs, mask, POLICY: tl.constexpr, DY_TERMS: tl.constexpr):
    """The upstream gradient at ``DY + offs``, in DY's dtype: DY's own, or with DY_TERMS 2 to 5
    the sum of that many terms (DY, DY2, ... at the same offsets) as Inductor computes a sum of
    gradients it fuses: in fp32, rounded once to DY's dtype."""
    dy, dy2, dy3, dy4, dy5 = _load_terms(DY, DY2, DY3, DY4, DY5, offs, mask, POLICY, DY_TERMS)
    return _sum_terms(dy, dy2, dy3, dy4, dy5, DY_TERMS)


@triton.jit
def _load_terms(DY, DY2, DY3, DY4, DY5, offs, mask, POLICY: tl.constexpr, DY_TERMS: tl.constexpr):
    """The ``DY_TERMS`` gradient terms at ``offs`` as loaded (0 where masked), unsummed; the
    terms past ``DY_TERMS`` are DY's values again, for ``_sum_terms`` to leave."""
    dy = tl.load(DY + offs, mask=mask, other=0.0, eviction_policy=POLICY)
    dy2 = dy
    dy3 = dy
    dy4 = dy
    dy5 = dy
    if DY_TERMS > 1:
        dy2 = tl.load(DY2 + offs, mask=mask, other=0.0, eviction_policy=POLICY)
    if DY_TERMS > 2:
        dy3 = tl.load(DY3 + offs, mask=mask, other=0.0, eviction_policy=POLICY)
    if DY_TERMS > 3:
        dy4 = tl.load(DY4 + offs, mask=mask, other=0.0, eviction_policy=POLICY)
    if DY_TERMS > 4:
        dy5 = tl.load(DY5 + offs, mask=mask, other=0.0, eviction_policy=POLICY)
    return dy, dy2, dy3, dy4, dy5


@triton.jit
def _sum_terms(dy, dy2, dy3, dy4, dy5, DY_TERMS: tl.constexpr):
    """``dy``, or the sum of ``DY_TERMS`` (2 to 5) terms of one dtype as Inductor computes a sum
    of gradients it fuses: in fp32, in order, rounded once to their dtype."""
    if DY_TERMS > 1:
        total = dy.to(tl.float32) + dy2.to(tl.float32)
        if DY_TERMS > 2:
            total += dy3.to(tl.float32)
        if DY_TERMS > 3:
            total += dy4.to(tl.float32)
        if DY_TERMS > 4:
            total += dy5.to(tl.float32)
        dy = total.to(dy.dtype)
    return dy


@triton.jit
def _merge_partial(value, ROW, mask, FLAG):
    """Add this program's dweight partial ``value`` into its pair's row ``ROW``: the first of the
    two to claim ``FLAG`` (0: free, 1: claimed, 2: stored) stores its partial, the second adds
    its own to what the first stored. fp32 addition is commutative, so the row holds the same
    bits whichever arrives first; and only a program that has claimed the flag is ever waited
    for, so nothing depends on which programs are resident. A lone program (odd group count)
    just stores."""
    if tl.atomic_cas(FLAG, 0, 1) == 0:
        tl.store(ROW, value, mask=mask)
        tl.debug_barrier()  # every thread's stores before the flag says so (acq_rel, gpu scope)
        tl.atomic_xchg(FLAG, 2)
    else:
        while tl.atomic_cas(FLAG, 2, 2) != 2:
            pass
        # From L2 (.cg): written by another multiprocessor.
        other = tl.load(ROW, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(ROW, other + value, mask=mask)


@triton.jit
def _store_partial(value, DW_PARTIAL, DW_FLAGS, group, N, cols, mask, SPLIT: tl.constexpr, chunk,
                   MERGE: tl.constexpr):
    """Write this program's dweight partial (columns ``cols`` of its group's): its group's row,
    or with MERGE its pair's (``_merge_partial``). The row is stored in DW_PARTIAL's dtype: with
    one row group the launcher passes dweight itself, and the partial is the sum."""
    if MERGE:
        _merge_partial(value, DW_PARTIAL + group // 2 * N + cols, mask, DW_FLAGS + group // 2 * SPLIT + chunk)
    else:
        tl.store(DW_PARTIAL + group * N + cols, value.to(DW_PARTIAL.dtype.element_ty), mask=mask)
