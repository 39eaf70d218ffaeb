"""Grouped GEMM: many NT GEMMs ``out_g = act(a_g @ b_g^T + bias_g)`` of equal or different
shapes in one launch, on bf16/fp16/fp32 operands or FP8 ones (tensor or row scales).

The host writes one metadata row per group (pointers, sizes, row strides) and the running
count of output tiles; program p finds its group by comparing p with those counts and
computes one tile of it. Tiles of all groups share one compiled kernel, so small GEMMs that
would each underfill the GPU fill it together, and launch overheads are paid once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from loka.kernels.epilogue import ACTIVATION_IDS, activation_tl, apply_epilogue, check_bias
from loka.kernels.formats import (
    HIGH_PRECISION_DTYPES,
    check_activation,
    check_high_precision_2d,
    check_out_dtype,
)
from loka.kernels.fp8_bits import fp8_decode_tl
from loka.kernels.fp8_gemm import check_fp8_operands, mm_reference
from loka.kernels.fp8_tensor import Fp8Tensor
from loka.kernels.runtime import autotuning, cdiv, interpreting, next_pow2, require_triton_device
from loka.kernels.torch_gemm import bf16_mm, scaled_mm

# Operand element kinds: how the kernel types a pointer it reads from the metadata.
KINDS = {
    torch.bfloat16: 0, torch.float16: 1, torch.float32: 2,
    torch.float8_e4m3fn: 3, torch.float8_e5m2: 4,
}  # fmt: skip
# Host metadata buffers copied by captured CUDA graphs, kept alive for their replays.
_CAPTURED_METADATA: list[torch.Tensor] = []
META_FIELDS = 12  # a, b, c, a_scale, b_scale, bias pointers; M, N, K; a, b, c row strides
# The tile launched without autotuning: BLOCK_M, N, K, warps, stages. Measured on an H200
# (bench/kernels.py --sections tune).
HEURISTIC_TILE: tuple[int, int, int, int, int] = (128, 128, 64, 8, 3)  # fmt: skip


@triton.jit
def _pointer(meta_ptr, field, KIND: tl.constexpr, SOFT_FP8: tl.constexpr):
    addr = tl.load(meta_ptr + field)
    if KIND == 0:
        return addr.to(tl.pointer_type(tl.bfloat16))
    elif KIND == 1:
        return addr.to(tl.pointer_type(tl.float16))
    elif KIND == 2:
        return addr.to(tl.pointer_type(tl.float32))
    elif SOFT_FP8:
        return addr.to(tl.pointer_type(tl.uint8))
    elif KIND == 3:
        return addr.to(tl.pointer_type(tl.float8e4nv))
    else:
        return addr.to(tl.pointer_type(tl.float8e5))


@triton.jit
def _grouped_gemm_kernel(
    meta_ptr, G, TOTAL_TILES_BUCKET, MAX_K,
    A_KIND: tl.constexpr, B_KIND: tl.constexpr, C_KIND: tl.constexpr, BIAS_KIND: tl.constexpr,
    SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    SOFT_FP8: tl.constexpr, G_POW2: tl.constexpr, ALIGNED: tl.constexpr,
    C_ALIGNED: tl.constexpr, UNIFORM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """SCALE: 0 none (high precision), 1 tensor, 2 row. UNIFORM: every group has one shape,
    and the grid is (tiles of one group, groups)."""
    if UNIFORM:
        g = tl.program_id(1)
        local = tl.program_id(0)
    else:
        # Which group owns tile `pid`: count each group's tiles for this config's block sizes.
        pid = tl.program_id(0)
        groups = tl.arange(0, G_POW2)
        g_ok = groups < G
        ms = tl.load(meta_ptr + groups * 12 + 6, mask=g_ok, other=0).to(tl.int32)
        ns = tl.load(meta_ptr + groups * 12 + 7, mask=g_ok, other=0).to(tl.int32)
        tiles = tl.cdiv(ms, BLOCK_M) * tl.cdiv(ns, BLOCK_N)
        ends = tl.cumsum(tiles, axis=0)
        g = tl.sum((ends <= pid).to(tl.int32), axis=0)
        local = pid - tl.sum(tl.where(groups < g, tiles, 0), axis=0)
    meta = meta_ptr + g * 12
    M = tl.load(meta + 6).to(tl.int32)
    N = tl.load(meta + 7).to(tl.int32)
    K = tl.load(meta + 8).to(tl.int32)
    lda = tl.load(meta + 9).to(tl.int32)
    ldb = tl.load(meta + 10).to(tl.int32)
    ldc = tl.load(meta + 11).to(tl.int32)
    a_ptr = _pointer(meta, 0, A_KIND, SOFT_FP8)
    b_ptr = _pointer(meta, 1, B_KIND, SOFT_FP8)
    c_ptr = _pointer(meta, 2, C_KIND, SOFT_FP8)
    if ALIGNED:  # checked on the host: lets the compiler vectorize and pipeline the loads
        K = tl.multiple_of(K, 16)
        a_ptr = tl.multiple_of(a_ptr, 16)
        b_ptr = tl.multiple_of(b_ptr, 16)
        lda = tl.multiple_of(lda, 16)
        ldb = tl.multiple_of(ldb, 16)
    if C_ALIGNED:  # 16-byte output rows: vector stores
        c_ptr = tl.multiple_of(c_ptr, 16)
        ldc = tl.multiple_of(ldc, 8)
    grid_n = tl.cdiv(N, BLOCK_N)
    offs_m = (local // grid_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (local % grid_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * lda + offs_k[None, :]
    b_ptrs = b_ptr + offs_n.to(tl.int64)[:, None] * ldb + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if SOFT_FP8:  # interpreter: its dot multiplies FP8 and bf16 bit patterns as integers
            if A_KIND >= 3:
                a = fp8_decode_tl(a, A_KIND - 3)
                b = fp8_decode_tl(b, B_KIND - 3)
            else:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
        if A_KIND == 2:  # float32 operands: full precision, as torch's default matmul
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
        elif SCALE == 0:
            acc = tl.dot(a, tl.trans(b), acc)
        else:
            acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=BLOCK_K)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if SCALE == 1:
        acc = acc * tl.load(_pointer(meta, 3, 2, False)) * tl.load(_pointer(meta, 4, 2, False))
    elif SCALE == 2:
        sa = tl.load(_pointer(meta, 3, 2, False) + offs_m, mask=m_ok, other=0.0)
        sb = tl.load(_pointer(meta, 4, 2, False) + offs_n, mask=n_ok, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        bias = tl.load(_pointer(meta, 5, BIAS_KIND, False) + offs_n, mask=n_ok, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    acc = activation_tl(acc, ACTIVATION)
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * ldc + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _configs() -> list[triton.Config]:
    shapes = [(64, 64, 64, 4, 3), (128, 64, 64, 4, 3), (128, 128, 64, 8, 3), (64, 128, 128, 4, 3),
              (128, 128, 128, 8, 3)]  # fmt: skip
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
        for bm, bn, bk, w, s in shapes
    ]


def _quick_bench(fn, quantiles=None):
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


_grouped_gemm_autotuned = triton.autotune(
    configs=_configs(),
    key=["TOTAL_TILES_BUCKET", "MAX_K", "A_KIND", "B_KIND", "SCALE", "HAS_BIAS", "ACTIVATION"],
    do_bench=_quick_bench,
)(_grouped_gemm_kernel)


def _data(t: torch.Tensor | Fp8Tensor) -> torch.Tensor:
    return t.data if isinstance(t, Fp8Tensor) else t


def _plainly_valid(a: Sequence, b: Sequence) -> bool:
    """The common case of high-precision groups, checked in one sweep (host time is most of
    a grouped GEMM's time at small shapes); False sends the caller to the per-group checks,
    which name the problem."""
    ts = (*a, *b)
    if not all(isinstance(t, torch.Tensor) for t in ts):
        return False
    dtype = a[0].dtype
    if dtype not in HIGH_PRECISION_DTYPES:
        return False
    if any(t.dtype != dtype or t.dim() != 2 or t.stride(1) != 1 for t in ts):
        return False
    return all(x.shape[1] == y.shape[1] for x, y in zip(a, b, strict=True))


def _check_groups(a: Sequence, b: Sequence, bias: Sequence | None) -> tuple[bool, str | None]:
    """Validate the lists; returns (is_fp8, granularity of the FP8 scales or None)."""
    if len(a) != len(b) or not a:
        raise ValueError(
            f"a and b must be non-empty lists of one length, got {len(a)} and {len(b)}"
        )
    if bias is not None and len(bias) != len(a):
        raise ValueError(f"bias must have one entry per group ({len(a)}), got {len(bias)}")
    fp8 = isinstance(a[0], Fp8Tensor)
    if not fp8 and _plainly_valid(a, b):
        return False, None
    for g, (ag, bg) in enumerate(zip(a, b, strict=True)):
        if fp8:
            check_fp8_operands(ag, bg)
            if ag.granularity not in ("tensor", "row") or ag.granularity != bg.granularity:
                raise ValueError(
                    f"group {g}: grouped FP8 takes tensor or row scales on both operands"
                )
            if (ag.fmt, bg.fmt, ag.granularity) != (a[0].fmt, b[0].fmt, a[0].granularity):
                raise ValueError(f"group {g}: every group must share formats and granularity")
        else:
            check_high_precision_2d(ag, f"a[{g}]")
            check_high_precision_2d(bg, f"b[{g}]")
            if ag.shape[1] != bg.shape[1]:
                raise ValueError(
                    f"group {g}: a {tuple(ag.shape)} and b {tuple(bg.shape)} differ in K"
                )
            if ag.stride(1) != 1 or bg.stride(1) != 1:
                raise ValueError(f"group {g}: operands must be contiguous along K")
            if (ag.dtype, bg.dtype) != (a[0].dtype, a[0].dtype):
                raise TypeError(f"group {g}: every operand must have dtype {a[0].dtype}")
    return fp8, a[0].granularity if fp8 else None


def stacked_view(ts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The ``[G, rows, cols]`` view holding every tensor of `ts` when they are equally shaped
    views of one buffer at a constant step (``x.unbind(0)``, per-feature slices of one
    activation); None otherwise. No data moves."""
    t0 = ts[0]
    shape, strides = t0.shape, t0.stride()
    if any(t.shape != shape or t.stride() != strides or t.dtype != t0.dtype for t in ts):
        return None
    ptrs = [t.data_ptr() for t in ts]
    step, size = (ptrs[1] - ptrs[0] if len(ts) > 1 else 0), t0.element_size()
    if (step <= 0 and len(ts) > 1) or step % size:
        return None
    if any(p != ptrs[0] + g * step for g, p in enumerate(ptrs)):
        return None
    try:  # torch refuses a view past t0's storage: tensors that merely sit side by side
        return t0.as_strided((len(ts), *shape), (step // size, *strides))
    except RuntimeError:
        return None


def _batched_mm(
    a3: torch.Tensor,
    b3: torch.Tensor,
    bias: list[torch.Tensor] | None,
    activation: str | None,
    out_dtype: torch.dtype,
) -> list[torch.Tensor]:
    """Equal high-precision groups stacked in one buffer: one batched cuBLAS GEMM."""
    if bias is None:
        y = torch.bmm(a3, b3.transpose(1, 2))
    else:
        y = torch.baddbmm(torch.stack(bias).to(a3.dtype)[:, None, :], a3, b3.transpose(1, 2))
    return list(apply_epilogue(y, None, activation).to(out_dtype).unbind(0))


def triton_grouped_mm(
    a: Sequence[torch.Tensor | Fp8Tensor],
    b: Sequence[torch.Tensor | Fp8Tensor],
    *,
    bias: Sequence[torch.Tensor] | None = None,
    activation: str | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> list[torch.Tensor]:
    """``[act(a[g] @ b[g].T + bias[g]) for g]`` in one Triton launch.

    High-precision groups of one shape that are views of one buffer each (``x.unbind(0)``)
    go to one batched cuBLAS GEMM instead (on a GPU): same result, no metadata to build.
    """
    fp8, granularity = _check_groups(a, b, bias)
    check_activation(activation)
    check_out_dtype(out_dtype)
    device = _data(a[0]).device
    require_triton_device(*[_data(t) for t in (*a, *b)])
    if bias is not None:
        bias = [check_bias(bg, _data(b[g]).shape[0], device) for g, bg in enumerate(bias)]
        if len({bg.dtype for bg in bias}) != 1:
            raise TypeError("every group's bias must have one dtype")
    if not fp8 and device.type == "cuda":
        a3, b3 = stacked_view(a), stacked_view(b)
        if a3 is not None and b3 is not None:
            return _batched_mm(a3, b3, bias, activation, out_dtype)
    sizes = [(_data(ag).shape[0], _data(bg).shape[0]) for ag, bg in zip(a, b, strict=True)]
    flat = torch.empty(sum(m * n for m, n in sizes), dtype=out_dtype, device=device)
    outs, offset = [], 0
    for m, n in sizes:
        outs.append(flat[offset : offset + m * n].view(m, n))
        offset += m * n
    soft = interpreting()
    meta = []
    for g, (ag, bg, cg) in enumerate(zip(a, b, outs, strict=True)):
        ad, bd = _data(ag), _data(bg)
        scales = (ag.inv_scale.data_ptr(), bg.inv_scale.data_ptr()) if fp8 else (0, 0)
        bias_ptr = bias[g].data_ptr() if bias is not None else 0
        meta += [ad.data_ptr(), bd.data_ptr(), cg.data_ptr(), *scales, bias_ptr,
                 ad.shape[0], bd.shape[0], ad.shape[1], ad.stride(0), bd.stride(0), cg.stride(0)]  # fmt: skip
    # From pinned memory the copy is asynchronous; from pageable memory it would wait for
    # the GPU to drain its queue first.
    pinned = device.type == "cuda"
    host = torch.tensor(meta, dtype=torch.int64, pin_memory=pinned)
    meta_t = host.to(device, non_blocking=True)
    if pinned and torch.cuda.is_current_stream_capturing():
        # A captured CUDA graph copies from this host buffer at every replay: keep it.
        _CAPTURED_METADATA.append(host)
    G = len(a)
    args = dict(
        A_KIND=KINDS[_data(a[0]).dtype], B_KIND=KINDS[_data(b[0]).dtype], C_KIND=KINDS[out_dtype],
        BIAS_KIND=KINDS[bias[0].dtype] if bias is not None else 0,
        SCALE={None: 0, "tensor": 1, "row": 2}[granularity], HAS_BIAS=bias is not None,
        ACTIVATION=ACTIVATION_IDS[activation], SOFT_FP8=soft, G_POW2=next_pow2(G),
        ALIGNED=all(
            _data(t).data_ptr() % 16 == 0 and _data(t).stride(0) % 16 == 0 and _data(t).shape[1] % 16 == 0
            for t in (*a, *b)
        ),
        C_ALIGNED=all(c.data_ptr() % 16 == 0 and c.shape[1] % 8 == 0 for c in outs),
    )  # fmt: skip
    max_k = next_pow2(max(_data(t).shape[1] for t in a))

    uniform = len(set(sizes)) == 1 and len({_data(t).shape[1] for t in a}) == 1
    args["UNIFORM"] = uniform

    def grid(cfg):
        if uniform:
            m, n = sizes[0]
            return (cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"]), G)
        return (sum(cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"]) for m, n in sizes),)

    if soft or not autotuning():  # one tile: the interpreter's, or a heuristic one
        fixed = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32}
        if not soft:
            bm, bn, bk, warps, stages = HEURISTIC_TILE
            fixed = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps,
                     "num_stages": stages}  # fmt: skip
        _grouped_gemm_kernel[grid(fixed)](meta_t, G, 0, max_k, **args, **fixed)
    else:
        work = next_pow2(sum(m * n for m, n in sizes))
        _grouped_gemm_autotuned[grid](meta_t, G, work, max_k, **args)
    return outs


def loop_grouped_mm(
    a: Sequence[torch.Tensor | Fp8Tensor],
    b: Sequence[torch.Tensor | Fp8Tensor],
    *,
    bias: Sequence[torch.Tensor] | None = None,
    activation: str | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    mm=None,
) -> list[torch.Tensor]:
    """The baseline: one `mm` call per group (default `bf16_mm` or `scaled_mm` by operand)."""
    fp8, _ = _check_groups(a, b, bias)
    mm = mm or (scaled_mm if fp8 else bf16_mm)
    return [
        mm(
            ag,
            bg,
            bias=None if bias is None else bias[g],
            activation=activation,
            out_dtype=out_dtype,
        )
        for g, (ag, bg) in enumerate(zip(a, b, strict=True))
    ]


def grouped_mm_reference(a: Sequence, b: Sequence, **epilogue) -> list[torch.Tensor]:
    """Pure torch: `mm_reference` of each group (keywords as `triton_grouped_mm`)."""
    return loop_grouped_mm(a, b, mm=mm_reference, **epilogue)
