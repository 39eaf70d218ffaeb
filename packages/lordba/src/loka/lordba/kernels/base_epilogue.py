"""The base GEMM with LoRDBA's up-projection in its epilogue: one kernel for the whole output.

    out[M, N] = x @ W^T / w_scale + bias + alpha * col_scale * ((t * rank_scale) @ S)

``x: [M, K]``; ``W: [N, K]`` either a float weight of ``x``'s dtype (``nn.Linear``) or FP8
codes stored as ``uint8`` with a float32 scale per output channel (``dequant = code /
w_scale``, :class:`~loka.lordba.quantized.Fp8WeightOnlyLinear`), converted to ``x``'s dtype
in registers; ``t: [M, R]`` float32 rank activations (``sign_down``'s output, i.e.
``(x * q) @ sign(A)^T``); ``S: [R, N]`` packed along N (``sign(B)^T`` as LoRDBA stores it).
Each program computes one ``[BLOCK_M, BLOCK_N]`` output tile of the GEMM, then, before its
one store, one more small ``tl.dot``: its rows of ``t`` (``[BLOCK_M, R]``, scaled by
``rank_scale * alpha``) against its columns of the unpacked signs (``[R, BLOCK_N]``, scaled by
``col_scale`` and, for FP8, by ``w_scale``, so the product accumulates into the GEMM's own
accumulator before the per-channel division). The ``[M, N]`` update is never written nor
read back, which is what the two-launch forms (``sign_up`` into the base output, or the
update as ``addmm``'s accumulator) pay for. Without ``t`` (``rank_act=None``) the kernel is
the base GEMM alone: the comparison point for what the epilogue costs, and for an FP8
weight-only base a GEMM that reads the FP8 bytes instead of a dequantized copy.

The down-projection stays a separate pass (``sign_down``: one read of ``x``, ``[M, R]``
float32 written). Folding it into this GEMM's K loop would repeat it per column tile
(``R / BLOCK_N`` more MMA work, 6-12% at R = 16, plus the sign unpacking per K step), more
than the separate pass's one read of ``x`` (about ``K / (2 N)`` of the GEMM's memory
traffic's worth, but bandwidth-bound and short next to a compute-bound GEMM).

Numerics: dot operands in ``x``'s dtype (float32 ``x`` uses IEEE float32 dots, not TF32, like
torch's default matmul), float32 accumulation; the up-projection's dot is float32 (TF32 on
the GPU, as ``sign_up``'s); one rounding to the output dtype. Not yet measured on a GPU: the
tiles below are a first guess for sm_90 bf16 GEMMs, untuned.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loka.kernels.runtime import capability, cdiv, next_pow2
from loka.lordba.kernels import _launch
from loka.lordba.kernels._tiles import mma, unpack_sign_tile
from loka.lordba.kernels.packing import unpack_signs

# W's kinds (constexpr WEIGHT): a float weight of x's dtype, or FP8 codes of either format.
PLAIN, FP8_E4M3, FP8_E5M2 = 0, 1, 2
_FP8_KINDS = {"e4m3": FP8_E4M3, "e5m2": FP8_E5M2}
_FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@triton.jit
def _weight_tile(w, WEIGHT: tl.constexpr, INTERPRETER: tl.constexpr):
    """A loaded weight tile as floats the caller casts to its dot dtype: a float weight as it
    is, FP8 codes (uint8) reinterpreted as FP8 (every FP8 value is exactly a bf16/fp16/fp32
    value). The interpreter widens FP8 exactly only to float32 and bf16 (not e5m2's subnormals
    to fp16), so there it goes through float32."""
    # One return, no early ones: Triton's code generator visits the code after an early return.
    if WEIGHT == 0:
        out = w
    elif WEIGHT == 1:
        out = w.to(tl.float8e4nv, bitcast=True)
    else:
        out = w.to(tl.float8e5, bitcast=True)
    if WEIGHT != 0 and INTERPRETER:
        out = out.to(tl.float32)
    return out


@triton.jit
def _gemm_dot(a, b, acc, IEEE: tl.constexpr, INTERPRETER: tl.constexpr):
    """``acc + a @ b``; ``IEEE``: float32 operands multiplied in float32, not TF32."""
    if IEEE and not INTERPRETER:
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = mma(a, b, acc, INTERPRETER)
    return out


@triton.jit
def _linear_sign_up_kernel(
    x_ptr,
    w_ptr,
    w_scale_ptr,
    bias_ptr,
    t_ptr,
    packed_ptr,
    rank_scale_ptr,
    col_scale_ptr,
    out_ptr,
    M,
    N,
    K,
    R,
    alpha,
    stride_xm,
    stride_wn,
    stride_tm,
    stride_pr,
    stride_om,
    M_BUCKET,
    WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_ADAPTER: tl.constexpr,
    HAS_RANK_SCALE: tl.constexpr,
    HAS_COL_SCALE: tl.constexpr,
    IEEE: tl.constexpr,
    INTERPRETER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Tiles sharing a band of GROUP_M row blocks run together, so W's tiles stay in L2.
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    group_size = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_size
    pid_n = (pid % width) // group_size

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    # int64 row offsets: M * K and N * K pass 2**31 elements on large activations / weights.
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :]
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0)
        w = _weight_tile(w, WEIGHT, INTERPRETER).to(x.dtype)
        acc = _gemm_dot(x, tl.trans(w), acc, IEEE, INTERPRETER)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    if WEIGHT != 0:
        w_scale = tl.load(w_scale_ptr + cols, mask=col_ok, other=1.0).to(tl.float32)
    if HAS_ADAPTER:
        # (t * rank_scale * alpha) @ (S * col_scale [* w_scale]), into the GEMM's accumulator:
        # the scales ride on the [BLOCK_M, R] and [R, BLOCK_N] operands, not on the output tile.
        ranks = tl.arange(0, BLOCK_R)
        rank_ok = ranks < R
        t = tl.load(
            t_ptr + rows.to(tl.int64)[:, None] * stride_tm + ranks[None, :],
            mask=row_ok[:, None] & rank_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        if HAS_RANK_SCALE:
            t = t * tl.load(rank_scale_ptr + ranks, mask=rank_ok, other=0.0).to(tl.float32)[None, :]
        t = t * alpha
        signs = unpack_sign_tile(
            packed_ptr, ranks, (pid_n * BLOCK_N) // 8, stride_pr, R, N, BLOCK_R, BLOCK_N
        )
        if HAS_COL_SCALE:
            signs = (
                signs
                * tl.load(col_scale_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            )
        if WEIGHT != 0:
            signs = signs * w_scale[None, :]
        acc = mma(t, signs, acc, INTERPRETER)  # float32 operands: TF32 on the GPU
    if WEIGHT != 0:
        acc = acc / w_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def _configs() -> list[triton.Config]:
    shapes = [  # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages: sm_90 bf16 GEMMs, M 512..8192
        (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
        (128, 128, 128, 8, 3), (64, 256, 64, 4, 4), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4),
    ]  # fmt: skip
    return [
        triton.Config(
            {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w, num_stages=s
        )
        for bm, bn, bk, w, s in shapes
    ]


def _prune(configs, named_args, **kwargs):
    """Drop tiles much larger than the problem: they only add masked work."""
    m = max(64, next_pow2(named_args["M"]))
    n = max(64, next_pow2(named_args["N"]))
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= m and c.kwargs["BLOCK_N"] <= n]
    return kept or configs[:1]


_linear_sign_up_tuned = triton.autotune(
    configs=_configs(),
    key=["M_BUCKET", "N", "K", "R", "WEIGHT", "HAS_ADAPTER", "IEEE"],
    prune_configs_by={"early_config_prune": _prune},
)(_linear_sign_up_kernel)
# Under the interpreter: small tiles, so the tests cross every tile boundary and the grouping.
_INTERPRETED = triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2})
_SMS = 132  # an H100/H200


def _heuristic(rows: int, out_features: int) -> triton.Config:
    """The one tile without autotuning (LOKA_KERNELS_AUTOTUNE=0): 128 x 256 where that still
    fills the GPU's SMs, else 128 x 128, else 64 x 128 (few tokens)."""
    if cdiv(rows, 128) * cdiv(out_features, 256) >= _SMS:
        bm, bn, warps, stages = 128, 256, 8, 3
    elif cdiv(rows, 128) * cdiv(out_features, 128) >= _SMS // 2:
        bm, bn, warps, stages = 128, 128, 8, 4
    else:
        bm, bn, warps, stages = 64, 128, 4, 4
    config = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 64, "GROUP_M": 8}
    return triton.Config(config, num_warps=warps, num_stages=stages)


def _weight_kind(weight: torch.Tensor, x: torch.Tensor, weight_scale, fp8_format) -> int:
    out_features, in_features = weight.shape if weight.dim() == 2 else (-1, -1)
    if weight.dim() != 2 or in_features != x.shape[1]:
        raise ValueError(f"weight: expected shape (N, {x.shape[1]}), got {tuple(weight.shape)}")
    if weight.dtype == torch.uint8:
        if fp8_format not in _FP8_KINDS:
            raise ValueError(f"fp8_format: expected 'e4m3' or 'e5m2', got {fp8_format!r}")
        if weight_scale is None:
            raise ValueError("weight_scale: an FP8 weight (uint8 codes) needs its [N] scales")
        _launch.check_vector(weight_scale, "weight_scale", out_features)
        return _FP8_KINDS[fp8_format]
    if weight.dtype != x.dtype:
        raise TypeError(
            f"weight: a float weight must have x's dtype {x.dtype}, got {weight.dtype} (FP8 "
            "weights come as uint8 codes)"
        )
    if weight_scale is not None:
        raise ValueError("weight_scale: only an FP8 (uint8) weight takes scales")
    return PLAIN


def _check_operands(x, weight, weight_scale, fp8_format, bias, rank_act, packed, scales):
    _launch.check_matrix(x, "x", (-1, -1))
    kind = _weight_kind(weight, x, weight_scale, fp8_format)
    out_features = weight.shape[0]
    _launch.check_vector(bias, "bias", out_features)
    rank_scale, col_scale = scales
    if rank_act is None:
        if packed is not None or rank_scale is not None or col_scale is not None:
            raise ValueError("packed/rank_scale/col_scale given without rank_act")
        return kind, out_features, 0
    _launch.check_matrix(rank_act, "rank_act", (x.shape[0], -1))
    rank = rank_act.shape[1]
    if packed is None:
        raise ValueError("rank_act given without the packed signs of the up-projection")
    _launch.check_signs(packed, rank, out_features, "packed signs")
    _launch.check_vector(rank_scale, "rank_scale", rank)
    _launch.check_vector(col_scale, "col_scale", out_features)
    return kind, out_features, rank


def linear_sign_up(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    weight_scale: torch.Tensor | None = None,
    fp8_format: str = "e4m3",
    bias: torch.Tensor | None = None,
    rank_act: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
    rank_scale: torch.Tensor | None = None,
    col_scale: torch.Tensor | None = None,
    alpha: float = 1.0,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x @ W^T / weight_scale + bias + alpha * col_scale * ((rank_act * rank_scale) @ S)``
    in one GEMM kernel, ``[M, N]`` in ``out_dtype`` (default ``x``'s).

    ``weight``: ``[N, K]`` of ``x``'s dtype, or FP8 codes as ``uint8`` (``fp8_format`` "e4m3"
    or "e5m2") with ``weight_scale`` ``[N]`` (float32; ``dequant = code / scale``).
    ``rank_act``: ``[M, R]`` (float32, ``sign_down``'s output) and ``packed``:
    ``uint8[R, ceil(N/8)]``; without them the kernel is the base GEMM alone.
    """
    kind, out_features, rank = _check_operands(
        x, weight, weight_scale, fp8_format, bias, rank_act, packed, (rank_scale, col_scale)
    )
    rows, length = x.shape
    out = torch.empty((rows, out_features), dtype=out_dtype or x.dtype, device=x.device)
    if rows == 0 or out_features == 0:
        return out
    if kind != PLAIN and x.device.type == "cuda" and (capability(x.device) or (0, 0)) < (8, 9):
        raise RuntimeError("FP8 weights need FP8 conversions in hardware: sm_89 or newer")
    x = _launch.unit_stride_rows(x)
    weight = _launch.unit_stride_rows(weight)
    adapter = rank > 0
    if adapter:
        rank_act = _launch.unit_stride_rows(rank_act)
    args = (
        x,
        weight,
        x if weight_scale is None else weight_scale.reshape(-1).contiguous(),
        x if bias is None else bias.contiguous(),
        rank_act if adapter else x,
        packed if adapter else x,
        rank_scale.contiguous() if adapter and rank_scale is not None else x,
        col_scale.contiguous() if adapter and col_scale is not None else x,
        out,
        rows,
        out_features,
        length,
        max(rank, 1),
        float(alpha),
        x.stride(0),
        weight.stride(0),
        rank_act.stride(0) if adapter else 0,
        packed.stride(0) if adapter else 0,
        out.stride(0),
        _launch.m_bucket(rows),
    )
    _launch.launch(
        _linear_sign_up_kernel,
        _linear_sign_up_tuned,
        lambda meta: (cdiv(rows, meta["BLOCK_M"]) * cdiv(out_features, meta["BLOCK_N"]),),
        args,
        device=x.device,
        interpreted=_INTERPRETED,
        heuristic=_heuristic(rows, out_features),
        WEIGHT=kind,
        HAS_BIAS=bias is not None,
        HAS_ADAPTER=adapter,
        HAS_RANK_SCALE=adapter and rank_scale is not None,
        HAS_COL_SCALE=adapter and col_scale is not None,
        IEEE=x.dtype == torch.float32,
        BLOCK_R=_launch.rank_block(rank) if adapter else 16,
    )
    return out


def linear_sign_up_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    weight_scale: torch.Tensor | None = None,
    fp8_format: str = "e4m3",
    bias: torch.Tensor | None = None,
    rank_act: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
    rank_scale: torch.Tensor | None = None,
    col_scale: torch.Tensor | None = None,
    alpha: float = 1.0,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Pure-torch :func:`linear_sign_up` (float32 arithmetic, one rounding to ``out_dtype``)."""
    kind, out_features, rank = _check_operands(
        x, weight, weight_scale, fp8_format, bias, rank_act, packed, (rank_scale, col_scale)
    )
    if kind == PLAIN:
        w = weight.float()
    else:
        codes = weight.view(_FP8_DTYPES[fp8_format]).float()
        w = codes / weight_scale.reshape(-1, 1).float()
    result = x.float() @ w.T
    if bias is not None:
        result = result + bias.float()
    if rank > 0:
        left = rank_act.float() if rank_scale is None else rank_act.float() * rank_scale.float()
        update = (left @ unpack_signs(packed, out_features)) * alpha
        result = result + (update if col_scale is None else update * col_scale.float())
    return result.to(out_dtype or x.dtype)
