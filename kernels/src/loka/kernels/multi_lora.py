"""Segmented multi-LoRA GEMMs: many LoRA adapters of different ranks over one token batch.

A packed batch holds the tokens of N LoRA jobs that share one frozen base linear
`y = x W^T`. Adapter i owns a contiguous token segment and adds `s_i (x A_i^T) B_i^T`,
with `A_i: [r_i, K]`, `B_i: [N_out, r_i]`, `s_i = alpha_i / r_i`. The adapters' factors are
concatenated along the rank dimension (`a_cat: [sum r, K]`, `b_cat: [N_out, sum r]`) so one
launch serves all of them:

- shrink  `h[t, :r_i] = x[t] A_i^T`                (tiled over tokens and rank, loops over K)
- expand  `y[t] = base[t] + s_i h[t, :r_i] B_i^T`  (tiled over tokens and N_out)
- wgrad   `dA_i = dh_i^T x_i`, `dB_i = s_i dy_i^T h_i` (tiled over the output, loops over
  the adapter's own tokens, so adapter i's gradient never sums another adapter's tokens)

Backward: `dh = s_i dy B_i` is a shrink, `dx = dh A_i` an expand, `dA`/`dB` are wgrads.
Each kernel has its launcher beside it and a pure-torch reference beside that.
`multi_lora_linear` ties them into one autograd op.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from loka.kernels.runtime import autotuning, require_triton_device

__all__ = [
    "MultiLoraLayout",
    "lora_expand",
    "lora_expand_reference",
    "lora_shrink",
    "lora_shrink_reference",
    "lora_wgrad",
    "lora_wgrad_reference",
    "multi_lora_kernels_available",
    "multi_lora_linear",
    "multi_lora_linear_loop",
    "multi_lora_linear_reference",
]

_MAX_BLOCK_R = 128
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------------------
# Layout: which tokens and which rank rows belong to each adapter
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class MultiLoraLayout:
    """Token segments and rank slices of N adapters in a packed batch.

    Adapter i owns rows `[token_starts[i], token_ends[i])` of the flattened `[T, K]` input
    (empty segments are allowed: that adapter gets zero gradients) and rows
    `[rank_offsets[i], rank_offsets[i] + ranks[i])` of `a_cat` (columns of `b_cat`).
    Segments must be disjoint and cover all T tokens. Build one per batch with
    `from_token_counts` or `from_segments`; it is shared by every layer of the model.
    """

    token_starts: tuple[int, ...]
    token_ends: tuple[int, ...]
    ranks: tuple[int, ...]
    scales: tuple[float, ...]
    device: torch.device
    rank_offsets: tuple[int, ...] = field(init=False)
    meta: torch.Tensor = field(init=False, repr=False)  # int32 [4, N] on device
    scale_tensor: torch.Tensor = field(init=False, repr=False)  # float32 [N] on device

    def __post_init__(self) -> None:
        n = len(self.ranks)
        if n == 0:
            raise ValueError("MultiLoraLayout needs at least one adapter")
        if not (len(self.token_starts) == len(self.token_ends) == len(self.scales) == n):
            raise ValueError(
                f"token_starts ({len(self.token_starts)}), token_ends ({len(self.token_ends)}), "
                f"ranks ({n}) and scales ({len(self.scales)}) must have one entry per adapter"
            )
        for i, (r, s) in enumerate(zip(self.ranks, self.scales, strict=True)):
            if int(r) < 1:
                raise ValueError(f"adapter {i}: rank must be >= 1, got {r}")
            if not math.isfinite(float(s)):
                raise ValueError(f"adapter {i}: scale must be finite, got {s}")
        spans = sorted(zip(self.token_starts, self.token_ends, strict=True))
        cursor = 0
        for start, end in spans:
            if end < start:
                raise ValueError(f"token segment [{start}, {end}) has negative length")
            if start == end:
                continue
            if start != cursor:
                raise ValueError(
                    f"token segments must be disjoint and cover [0, T) without gaps; "
                    f"segment [{start}, {end}) starts at {start}, expected {cursor}"
                )
            cursor = end
        offsets, total = [], 0
        for r in self.ranks:
            offsets.append(total)
            total += int(r)
        object.__setattr__(self, "rank_offsets", tuple(offsets))
        host = torch.tensor(
            [list(self.token_starts), list(self.token_ends), list(self.ranks), offsets],
            dtype=torch.int32,
        )
        object.__setattr__(self, "meta", host.to(self.device, non_blocking=True))
        object.__setattr__(
            self,
            "scale_tensor",
            torch.tensor(self.scales, dtype=torch.float32).to(self.device, non_blocking=True),
        )

    @classmethod
    def from_token_counts(
        cls,
        tokens_per_adapter: Sequence[int],
        ranks: Sequence[int],
        scales: Sequence[float],
        device: torch.device | str = "cpu",
    ) -> MultiLoraLayout:
        """Adapters' tokens follow each other in adapter order: adapter 0 first."""
        starts, ends, cursor = [], [], 0
        for i, count in enumerate(tokens_per_adapter):
            if int(count) < 0:
                raise ValueError(f"adapter {i}: token count must be >= 0, got {count}")
            starts.append(cursor)
            cursor += int(count)
            ends.append(cursor)
        return cls(
            tuple(starts),
            tuple(ends),
            tuple(int(r) for r in ranks),
            tuple(float(s) for s in scales),
            torch.device(device),
        )

    @classmethod
    def from_segments(
        cls,
        token_starts: Sequence[int],
        token_ends: Sequence[int],
        ranks: Sequence[int],
        scales: Sequence[float],
        device: torch.device | str = "cpu",
    ) -> MultiLoraLayout:
        return cls(
            tuple(int(s) for s in token_starts),
            tuple(int(e) for e in token_ends),
            tuple(int(r) for r in ranks),
            tuple(float(s) for s in scales),
            torch.device(device),
        )

    @property
    def num_adapters(self) -> int:
        return len(self.ranks)

    @property
    def num_tokens(self) -> int:
        return max(self.token_ends)

    @property
    def max_segment(self) -> int:
        return max(e - s for s, e in zip(self.token_starts, self.token_ends, strict=True))

    @property
    def max_rank(self) -> int:
        return max(self.ranks)

    @property
    def total_rank(self) -> int:
        return sum(self.ranks)

    def tokens_of(self, adapter: int) -> int:
        return self.token_ends[adapter] - self.token_starts[adapter]


# --------------------------------------------------------------------------------------
# Shared device helpers
# --------------------------------------------------------------------------------------


@triton.jit
def _mma(a, b, acc, INTERPRETER: tl.constexpr):
    # Triton 3.6's interpreter keeps bf16 as raw uint16, so its tl.dot on bf16 returns
    # integer garbage; it multiplies correctly in fp32. Compiled kernels use the tensor cores.
    if INTERPRETER:
        return acc + tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b, acc)


@triton.jit
def _load_tile(ptr, rows, cols, stride_row, stride_col, row_mask, col_mask):
    return tl.load(
        ptr + rows[:, None] * stride_row + cols[None, :] * stride_col,
        mask=row_mask[:, None] & col_mask[None, :],
        other=0.0,
    )


@triton.jit
def _store_tile(ptr, value, rows, cols, stride_row, stride_col, row_mask, col_mask):
    tl.store(
        ptr + rows[:, None] * stride_row + cols[None, :] * stride_col,
        value.to(ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


@triton.jit
def _load_adapter(meta_ptr, num_adapters, adapter):
    start = tl.load(meta_ptr + adapter)
    end = tl.load(meta_ptr + num_adapters + adapter)
    rank = tl.load(meta_ptr + 2 * num_adapters + adapter)
    rank_offset = tl.load(meta_ptr + 3 * num_adapters + adapter)
    return start, end, rank, rank_offset


@triton.jit
def _token_block(meta_ptr, num_adapters, adapter, pid_t, BLOCK_T: tl.constexpr):
    """Rows of the pid_t-th token block of `adapter`'s segment (t0 >= end: nothing to do)."""
    start, end, rank, rank_offset = _load_adapter(meta_ptr, num_adapters, adapter)
    t0 = start + pid_t * BLOCK_T
    offs_t = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
    return t0, end, offs_t, offs_t < end, rank, rank_offset


def _block_r(max_rank: int) -> int:
    return max(16, min(_MAX_BLOCK_R, triton.next_power_of_2(max_rank)))


def _check_common(name: str, layout: MultiLoraLayout, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype not in _SUPPORTED_DTYPES:
            raise TypeError(
                f"{name}: unsupported dtype {t.dtype}; use float32, float16 or bfloat16"
            )
        if t.dim() != 2:
            raise ValueError(f"{name}: expected 2-D tensors, got shape {tuple(t.shape)}")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise TypeError(f"{name}: operands must share one dtype, got {sorted(map(str, dtypes))}")
    require_triton_device(*tensors)
    if not multi_lora_kernels_available(tensors[0].device):
        raise RuntimeError(
            f"{name}: Triton kernels need a CUDA GPU, or the CPU with TRITON_INTERPRET=1 set "
            f"before loka.kernels.multi_lora is imported; tensors are on {tensors[0].device}"
        )
    if layout.meta.device != tensors[0].device:
        raise ValueError(
            f"{name}: layout is on {layout.meta.device}, tensors on {tensors[0].device}; "
            "build the layout on the tensors' device"
        )


def multi_lora_kernels_available(device: torch.device | str) -> bool:
    """Whether the kernels can run on `device`: a CUDA GPU, or the CPU when Triton built
    them for its interpreter (TRITON_INTERPRET=1 when this module was first imported)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available()
    return device.type == "cpu" and not isinstance(_mma, triton.runtime.JITFunction)


def _autotuned(kernel, configs: list[triton.Config], key: list[str]):
    """The plain kernel (interpreter, heuristic tile) and its autotuned wrapper (GPU)."""
    return kernel, triton.autotune(configs=configs, key=key)(kernel)


def _launch(pair, device: torch.device, grid, tiles, args, **constexprs) -> None:
    """tiles: (the interpreter's config, the GPU's heuristic config); on the GPU the
    autotuner picks among the configs unless LOKA_KERNELS_AUTOTUNE=0."""
    plain, tuned = pair
    interpreted, heuristic = tiles
    if device.type == "cuda" and autotuning():
        tuned[grid](*args, **constexprs, INTERPRETER=False)
        return
    config = heuristic if device.type == "cuda" else interpreted
    plain[grid](
        *args,
        **constexprs,
        **config.kwargs,
        INTERPRETER=device.type != "cuda",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


# --------------------------------------------------------------------------------------
# Shrink: h[t, :r_i] = s? * x[t] @ W_i^T  with W_i = rows of `weight` owned by adapter i
# --------------------------------------------------------------------------------------


@triton.jit
def _shrink_kernel(
    x_ptr, w_ptr, out_ptr, meta_ptr, scale_ptr, num_adapters, K, R_OUT, stride_xt, stride_xk,
    stride_wr, stride_wk, stride_ot, stride_or,
    SCALED: tl.constexpr, INTERPRETER: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_t = tl.program_id(0)
    pid_r = tl.program_id(1)
    adapter = tl.program_id(2)
    t0, end, offs_t, mask_t, rank, rank_offset = _token_block(
        meta_ptr, num_adapters, adapter, pid_t, BLOCK_T
    )
    if t0 >= end:
        return
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank
    w_rows = (rank_offset + offs_r).to(tl.int64)
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = _load_tile(x_ptr, offs_t, offs_k, stride_xt, stride_xk, mask_t, mask_k)
        w = _load_tile(w_ptr, offs_k, w_rows, stride_wk, stride_wr, mask_k, mask_r)
        acc = _mma(x, w, acc, INTERPRETER)
    if SCALED:
        acc = acc * tl.load(scale_ptr + adapter)
    # Columns in [rank, R_OUT) are written as zeros: h is fully defined for every token.
    _store_tile(out_ptr, acc, offs_t, offs_r, stride_ot, stride_or, mask_t, offs_r < R_OUT)


_SHRINK_CONFIGS = [
    triton.Config({"BLOCK_T": 64, "BLOCK_K": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_T": 128, "BLOCK_K": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_T": 64, "BLOCK_K": 128}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_T": 128, "BLOCK_K": 128}, num_warps=8, num_stages=3),
]
_SHRINK = _autotuned(_shrink_kernel, _SHRINK_CONFIGS, key=["K", "R_OUT", "SCALED"])
# The interpreter pays ~50 ms per program whatever its tile size, so it gets large tiles.
_SHRINK_INTERPRETED = triton.Config({"BLOCK_T": 32, "BLOCK_K": 64})


def lora_shrink(
    x: torch.Tensor, weight: torch.Tensor, layout: MultiLoraLayout, *, scaled: bool = False
) -> torch.Tensor:
    """`h[t, :r_i] = x[t] @ weight[rows of i]^T` (times `s_i` when `scaled`), zero-padded.

    x: `[T, K]`; weight: `[sum r, K]` (any strides: the backward passes `b_cat.t()`).
    Returns `[T, max_rank]` in x's dtype; columns at or beyond an adapter's rank are zero.
    """
    _check_common("lora_shrink", layout, x, weight)
    if x.shape[0] != layout.num_tokens:
        raise ValueError(f"lora_shrink: x has {x.shape[0]} tokens, layout {layout.num_tokens}")
    if weight.shape != (layout.total_rank, x.shape[1]):
        raise ValueError(
            f"lora_shrink: weight shape {tuple(weight.shape)} != (sum of ranks "
            f"{layout.total_rank}, K {x.shape[1]})"
        )
    out = torch.empty(x.shape[0], layout.max_rank, device=x.device, dtype=x.dtype)
    block_r = _block_r(layout.max_rank)

    def grid(meta):
        return (
            triton.cdiv(layout.max_segment, meta["BLOCK_T"]),
            triton.cdiv(layout.max_rank, block_r),
            layout.num_adapters,
        )

    _launch(
        _SHRINK,
        x.device,
        grid,
        (_SHRINK_INTERPRETED, _SHRINK_CONFIGS[0]),
        (x, weight, out, layout.meta, layout.scale_tensor, layout.num_adapters, x.shape[1],
         layout.max_rank, *x.stride(), *weight.stride(), *out.stride()),
        SCALED=scaled,
        BLOCK_R=block_r,
    )  # fmt: skip
    return out


def lora_shrink_reference(
    x: torch.Tensor, weight: torch.Tensor, layout: MultiLoraLayout, *, scaled: bool = False
) -> torch.Tensor:
    out = torch.zeros(x.shape[0], layout.max_rank, device=x.device, dtype=torch.float32)
    for i in range(layout.num_adapters):
        s, e, r, o = _segment(layout, i)
        h = x[s:e].float() @ weight[o : o + r].float().t()
        out[s:e, :r] = h * layout.scales[i] if scaled else h
    return out.to(x.dtype)


# --------------------------------------------------------------------------------------
# Expand: y[t] = base[t] + s? * h[t, :r_i] @ W_i^T  with W_i = columns of `weight` of i
# --------------------------------------------------------------------------------------


@triton.jit
def _expand_kernel(
    h_ptr, w_ptr, base_ptr, out_ptr, meta_ptr, scale_ptr, num_adapters, N, R_MAX, stride_ht,
    stride_hr, stride_wn, stride_wr, stride_bt, stride_bn, stride_ot, stride_on,
    SCALED: tl.constexpr, HAS_BASE: tl.constexpr, INTERPRETER: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    adapter = tl.program_id(2)
    t0, end, offs_t, mask_t, rank, rank_offset = _token_block(
        meta_ptr, num_adapters, adapter, pid_t, BLOCK_T
    )
    if t0 >= end:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        h = _load_tile(h_ptr, offs_t, offs_r, stride_ht, stride_hr, mask_t, mask_r)
        w_cols = rank_offset + offs_r
        w = _load_tile(w_ptr, w_cols, offs_n, stride_wr, stride_wn, mask_r, mask_n)
        acc = _mma(h, w, acc, INTERPRETER)
    if SCALED:
        acc = acc * tl.load(scale_ptr + adapter)
    if HAS_BASE:
        base = _load_tile(base_ptr, offs_t, offs_n, stride_bt, stride_bn, mask_t, mask_n)
        acc = acc + base.to(tl.float32)
    _store_tile(out_ptr, acc, offs_t, offs_n, stride_ot, stride_on, mask_t, mask_n)


_EXPAND_CONFIGS = [
    triton.Config({"BLOCK_T": 64, "BLOCK_N": 64}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_T": 128, "BLOCK_N": 64}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_T": 64, "BLOCK_N": 128}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_T": 128, "BLOCK_N": 128}, num_warps=8, num_stages=2),
]
_EXPAND = _autotuned(_expand_kernel, _EXPAND_CONFIGS, key=["N", "R_MAX", "SCALED", "HAS_BASE"])
_EXPAND_INTERPRETED = triton.Config({"BLOCK_T": 32, "BLOCK_N": 64})


def lora_expand(
    h: torch.Tensor,
    weight: torch.Tensor,
    layout: MultiLoraLayout,
    *,
    base: torch.Tensor | None = None,
    scaled: bool = True,
) -> torch.Tensor:
    """`y[t] = base[t] + h[t, :r_i] @ weight[:, cols of i]^T` (times `s_i` when `scaled`).

    h: `[T, >= max_rank]`; weight: `[N, sum r]` (any strides: the backward passes
    `a_cat.t()`); base: `[T, N]` or None (then y is the adapter term alone).
    """
    _check_common("lora_expand", layout, h, weight, *([] if base is None else [base]))
    num_tokens, n = h.shape[0], weight.shape[0]
    if num_tokens != layout.num_tokens or h.shape[1] < layout.max_rank:
        raise ValueError(
            f"lora_expand: h shape {tuple(h.shape)} does not fit layout "
            f"(T {layout.num_tokens}, max rank {layout.max_rank})"
        )
    if weight.shape[1] != layout.total_rank:
        raise ValueError(
            f"lora_expand: weight has {weight.shape[1]} rank columns, layout {layout.total_rank}"
        )
    if base is not None and base.shape != (num_tokens, n):
        raise ValueError(f"lora_expand: base shape {tuple(base.shape)} != ({num_tokens}, {n})")
    out = torch.empty(num_tokens, n, device=h.device, dtype=h.dtype)
    block_r = _block_r(layout.max_rank)

    def grid(meta):
        return (
            triton.cdiv(layout.max_segment, meta["BLOCK_T"]),
            triton.cdiv(n, meta["BLOCK_N"]),
            layout.num_adapters,
        )

    base_arg = out if base is None else base  # never read when HAS_BASE is False
    _launch(
        _EXPAND,
        h.device,
        grid,
        (_EXPAND_INTERPRETED, _EXPAND_CONFIGS[0]),
        (h, weight, base_arg, out, layout.meta, layout.scale_tensor, layout.num_adapters, n,
         layout.max_rank, *h.stride(), *weight.stride(), *base_arg.stride(), *out.stride()),
        SCALED=scaled,
        HAS_BASE=base is not None,
        BLOCK_R=block_r,
    )  # fmt: skip
    return out


def lora_expand_reference(
    h: torch.Tensor,
    weight: torch.Tensor,
    layout: MultiLoraLayout,
    *,
    base: torch.Tensor | None = None,
    scaled: bool = True,
) -> torch.Tensor:
    out = torch.zeros(h.shape[0], weight.shape[0], device=h.device, dtype=torch.float32)
    if base is not None:
        out += base.float()
    for i in range(layout.num_adapters):
        s, e, r, o = _segment(layout, i)
        delta = h[s:e, :r].float() @ weight[:, o : o + r].float().t()
        out[s:e] += delta * layout.scales[i] if scaled else delta
    return out.to(h.dtype)


# --------------------------------------------------------------------------------------
# Wgrad: out_i = s? * left_i^T @ right_i, summed over adapter i's own tokens only
# --------------------------------------------------------------------------------------


@triton.jit
def _wgrad_kernel(
    left_ptr, right_ptr, out_ptr, meta_ptr, scale_ptr, num_adapters, P, Q, stride_lt, stride_lp,
    stride_rt, stride_rq, stride_op, stride_oq,
    RANK_ON_LEFT: tl.constexpr, SCALED: tl.constexpr, INTERPRETER: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    pid_p = tl.program_id(0)
    pid_q = tl.program_id(1)
    adapter = tl.program_id(2)
    start, end, rank, rank_offset = _load_adapter(meta_ptr, num_adapters, adapter)
    # The rank side of the product is limited by this adapter's rank and lands at its
    # rank offset in the concatenated gradient; the other side spans the full dimension.
    if RANK_ON_LEFT:
        p_limit = rank
        q_limit = Q
        out_base = rank_offset.to(tl.int64) * stride_op
    else:
        p_limit = P
        q_limit = rank
        out_base = rank_offset.to(tl.int64) * stride_oq
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    if pid_p * BLOCK_P >= p_limit:
        return
    if pid_q * BLOCK_Q >= q_limit:
        return
    mask_p = offs_p < p_limit
    mask_q = offs_q < q_limit
    acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    for t0 in range(start, end, BLOCK_T):
        offs_t = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
        mask_t = offs_t < end
        lhs = _load_tile(left_ptr, offs_p, offs_t, stride_lp, stride_lt, mask_p, mask_t)
        rhs = _load_tile(right_ptr, offs_t, offs_q, stride_rt, stride_rq, mask_t, mask_q)
        acc = _mma(lhs, rhs, acc, INTERPRETER)
    if SCALED:
        acc = acc * tl.load(scale_ptr + adapter)
    _store_tile(out_ptr + out_base, acc, offs_p, offs_q, stride_op, stride_oq, mask_p, mask_q)


_WGRAD_CONFIGS = [
    triton.Config({"BLOCK_P": 64, "BLOCK_Q": 64, "BLOCK_T": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_P": 64, "BLOCK_Q": 128, "BLOCK_T": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_P": 128, "BLOCK_Q": 64, "BLOCK_T": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_P": 32, "BLOCK_Q": 128, "BLOCK_T": 128}, num_warps=4, num_stages=3),
]
_WGRAD = _autotuned(_wgrad_kernel, _WGRAD_CONFIGS, key=["P", "Q", "RANK_ON_LEFT", "SCALED"])
_WGRAD_INTERPRETED = triton.Config({"BLOCK_P": 64, "BLOCK_Q": 64, "BLOCK_T": 32})


def lora_wgrad(
    left: torch.Tensor,
    right: torch.Tensor,
    layout: MultiLoraLayout,
    *,
    rank_on_left: bool,
    scaled: bool,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Per-adapter `left_i^T @ right_i` over adapter i's tokens, concatenated along rank.

    `rank_on_left=True` (dA): left `[T, >= max_rank]` (dh), right `[T, K]` (x); returns
    `[sum r, K]`. `rank_on_left=False` (dB): left `[T, N]` (dy), right `[T, >= max_rank]`
    (h); returns `[N, sum r]`. Adapters with no tokens get zeros.
    """
    _check_common("lora_wgrad", layout, left, right)
    if left.shape[0] != layout.num_tokens or right.shape[0] != layout.num_tokens:
        raise ValueError(
            f"lora_wgrad: left has {left.shape[0]} and right {right.shape[0]} tokens, "
            f"layout {layout.num_tokens}"
        )
    rank_side = left if rank_on_left else right
    if rank_side.shape[1] < layout.max_rank:
        raise ValueError(
            f"lora_wgrad: rank operand has {rank_side.shape[1]} columns < max rank {layout.max_rank}"
        )
    if rank_on_left:
        p, q = layout.max_rank, right.shape[1]
        out_shape = (layout.total_rank, q)
    else:
        p, q = left.shape[1], layout.max_rank
        out_shape = (p, layout.total_rank)
    out = torch.empty(out_shape, device=left.device, dtype=out_dtype or left.dtype)

    def grid(meta):
        return (
            triton.cdiv(p, meta["BLOCK_P"]),
            triton.cdiv(q, meta["BLOCK_Q"]),
            layout.num_adapters,
        )

    _launch(
        _WGRAD,
        left.device,
        grid,
        (_WGRAD_INTERPRETED, _WGRAD_CONFIGS[0]),
        (left, right, out, layout.meta, layout.scale_tensor, layout.num_adapters, p, q,
         *left.stride(), *right.stride(), *out.stride()),
        RANK_ON_LEFT=rank_on_left,
        SCALED=scaled,
    )  # fmt: skip
    return out


def lora_wgrad_reference(
    left: torch.Tensor,
    right: torch.Tensor,
    layout: MultiLoraLayout,
    *,
    rank_on_left: bool,
    scaled: bool,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    if rank_on_left:
        out = torch.zeros(layout.total_rank, right.shape[1], device=left.device)
    else:
        out = torch.zeros(left.shape[1], layout.total_rank, device=left.device)
    for i in range(layout.num_adapters):
        s, e, r, o = _segment(layout, i)
        lhs = left[s:e, :r] if rank_on_left else left[s:e]
        rhs = right[s:e] if rank_on_left else right[s:e, :r]
        grad = lhs.float().t() @ rhs.float()
        if scaled:
            grad = grad * layout.scales[i]
        if rank_on_left:
            out[o : o + r] = grad
        else:
            out[:, o : o + r] = grad
    return out.to(out_dtype or left.dtype)


def _segment(layout: MultiLoraLayout, i: int) -> tuple[int, int, int, int]:
    return layout.token_starts[i], layout.token_ends[i], layout.ranks[i], layout.rank_offsets[i]


# --------------------------------------------------------------------------------------
# The autograd op
# --------------------------------------------------------------------------------------


class _MultiLoraLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, base_out, a_cat, b_cat, layout):
        h = lora_shrink(x, a_cat, layout)
        y = lora_expand(h, b_cat, layout, base=base_out, scaled=True)
        ctx.save_for_backward(x, h, a_cat, b_cat)
        ctx.layout = layout
        return y

    @staticmethod
    def backward(ctx, dy):
        x, h, a_cat, b_cat = ctx.saved_tensors
        layout = ctx.layout
        dy = dy.contiguous()
        dh = lora_shrink(dy, b_cat.t(), layout, scaled=True)
        dx = lora_expand(dh, a_cat.t(), layout, scaled=False) if ctx.needs_input_grad[0] else None
        da = db = None
        if ctx.needs_input_grad[2]:
            da = lora_wgrad(dh, x, layout, rank_on_left=True, scaled=False, out_dtype=a_cat.dtype)
        if ctx.needs_input_grad[3]:
            db = lora_wgrad(dy, h, layout, rank_on_left=False, scaled=True, out_dtype=b_cat.dtype)
        return dx, dy if ctx.needs_input_grad[1] else None, da, db, None


def multi_lora_linear(
    x: torch.Tensor,
    base_out: torch.Tensor,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    layout: MultiLoraLayout,
) -> torch.Tensor:
    """`base_out + s_i (x A_i^T) B_i^T` per adapter segment, forward and backward in Triton.

    x: `[T, K]`; base_out: `[T, N]` (the frozen base linear's output, computed once for all
    adapters); a_cat: `[sum r, K]`; b_cat: `[N, sum r]`; all one dtype. Differentiable in
    x, base_out, a_cat and b_cat.
    """
    _check_linear_shapes(x, base_out, a_cat, b_cat, layout)
    return _MultiLoraLinear.apply(x, base_out, a_cat, b_cat, layout)


def multi_lora_linear_reference(
    x: torch.Tensor,
    base_out: torch.Tensor,
    a_list: Sequence[torch.Tensor],
    b_list: Sequence[torch.Tensor],
    layout: MultiLoraLayout,
) -> torch.Tensor:
    """The same result as a Python loop over adapters (differentiable, plain torch ops).

    Takes the per-adapter factors `A_i: [r_i, K]`, `B_i: [N, r_i]` rather than the
    concatenation; this is also the "loop" baseline the benchmark compares against.
    """
    if len(a_list) != layout.num_adapters or len(b_list) != layout.num_adapters:
        raise ValueError(
            f"expected {layout.num_adapters} adapters, got {len(a_list)} A and {len(b_list)} B"
        )
    order = sorted(range(layout.num_adapters), key=lambda i: layout.token_starts[i])
    pieces = []
    for i in order:
        s, e = layout.token_starts[i], layout.token_ends[i]
        if s == e:
            continue
        delta = (x[s:e] @ a_list[i].t()) @ b_list[i].t()
        pieces.append(base_out[s:e] + delta * layout.scales[i])
    return torch.cat(pieces)


def _check_linear_shapes(x, base_out, a_cat, b_cat, layout: MultiLoraLayout) -> None:
    t, k = x.shape
    if base_out.shape[0] != t:
        raise ValueError(f"x has {t} tokens but base_out {base_out.shape[0]}")
    if a_cat.shape != (layout.total_rank, k):
        raise ValueError(
            f"a_cat shape {tuple(a_cat.shape)} != (sum of ranks {layout.total_rank}, K {k})"
        )
    if b_cat.shape != (base_out.shape[1], layout.total_rank):
        raise ValueError(
            f"b_cat shape {tuple(b_cat.shape)} != (N {base_out.shape[1]}, "
            f"sum of ranks {layout.total_rank})"
        )


# --------------------------------------------------------------------------------------
# Registry: op "multi_lora", signature run(x, base_out, a_cat, b_cat, layout) -> y
# --------------------------------------------------------------------------------------


def multi_lora_linear_loop(
    x: torch.Tensor,
    base_out: torch.Tensor,
    a_cat: torch.Tensor,
    b_cat: torch.Tensor,
    layout: MultiLoraLayout,
) -> torch.Tensor:
    """`multi_lora_linear`'s signature over the Python loop (differentiable torch ops)."""
    _check_linear_shapes(x, base_out, a_cat, b_cat, layout)
    a_list = [a_cat[o : o + r] for o, r in zip(layout.rank_offsets, layout.ranks, strict=True)]
    b_list = [b_cat[:, o : o + r] for o, r in zip(layout.rank_offsets, layout.ranks, strict=True)]
    return multi_lora_linear_reference(x, base_out, a_list, b_list, layout)


def _register() -> None:
    from loka.kernels.registry import BF16, Backend, registry

    common = dict(
        op="multi_lora",
        reference=multi_lora_linear_loop,
        formats=frozenset({(BF16, BF16)}),
        granularities=frozenset({"none"}),
        min_capability=None,
    )
    registry.register(
        Backend(
            name="triton.multi_lora",
            run=multi_lora_linear,
            description="segmented shrink/expand/wgrad over N LoRA adapters in one launch each",
            triton=True,
            priority=1,
            **common,
        ),
        replace=True,
    )
    registry.register(
        Backend(
            name="torch.multi_lora_loop",
            run=multi_lora_linear_loop,
            description="a Python loop over the adapters with plain torch GEMMs",
            runs_on_cpu=True,
            **common,
        ),
        replace=True,
    )


_register()
