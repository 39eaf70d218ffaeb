"""Split wgrad: `dA_i = dh_i^T x_i` and `dB_i = s_i dy_i^T h_i` in one launch, split over tokens.

Each adapter's token segment is cut into chunks of at most `chunk_tokens` tokens
(`MultiLoraLayout.token_chunks`). Pass 1, one launch for both gradients and all adapters:
a program per (chunk, feature tile), the feature tiles being K's (dA) then N's (dB), sums
`small^T big` over its chunk only (`small` = dh or h: `[T, max_rank]`; `big` = x or dy) into
a `[rank, BLOCK_F]` fp32 tile and writes it to the chunk's rows of a partial buffer. Pass 2
(`_reduce_kernel`, a program per (adapter, feature tile)) adds the adapter's chunk partials
in chunk order, scales dB by `s_i` and writes dA and dB (transposed) in the output dtype.
Work per program is bounded by the chunk size whatever the adapter's token count; no atomics:
the result does not depend on scheduling. An adapter only ever sums its own tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loka.plora.kernels import _launch
from loka.plora.kernels._tiles import load_tile, mma, store_tile
from loka.plora.kernels.layout import MultiLoraLayout

CHUNK_TOKENS = 512  # tokens a pass-1 program sums (the GPU's default; tests pass smaller)


@triton.jit
def _chunk_product(
    small_ptr, big_ptr, start, end, rank, f0, limit, stride_st, stride_sr, stride_bt, stride_bf,
    INTERPRETER: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr,
    BLOCK_R: tl.constexpr,
):  # fmt: skip
    """`small[start:end, :rank]^T @ big[start:end, f0:f0 + BLOCK_F]` in fp32."""
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank
    offs_f = f0 + tl.arange(0, BLOCK_F)
    mask_f = offs_f < limit
    acc = tl.zeros((BLOCK_R, BLOCK_F), dtype=tl.float32)
    for t0 in range(start, end, BLOCK_T):
        offs_t = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
        mask_t = offs_t < end
        small = load_tile(small_ptr, offs_r, offs_t, stride_sr, stride_st, mask_r, mask_t)
        big = load_tile(big_ptr, offs_t, offs_f, stride_bt, stride_bf, mask_t, mask_f)
        acc = mma(small, big, acc, INTERPRETER)
    return acc


@triton.jit
def _partial_kernel(
    dh_ptr, x_ptr, h_ptr, dy_ptr, part_ptr, chunk_ptr, meta_ptr, num_chunks, num_adapters, K,
    N, stride_dht, stride_dhr, stride_xt, stride_xk, stride_ht, stride_hr, stride_dyt,
    stride_dyn, stride_pr, stride_pf,
    INTERPRETER: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr,
    BLOCK_R: tl.constexpr,
):  # fmt: skip
    chunk = tl.program_id(0)
    tile = tl.program_id(1)
    adapter = tl.load(chunk_ptr + chunk)
    start = tl.load(chunk_ptr + num_chunks + chunk)
    end = tl.load(chunk_ptr + 2 * num_chunks + chunk)
    row0 = tl.load(chunk_ptr + 3 * num_chunks + chunk)
    rank = tl.load(meta_ptr + 2 * num_adapters + adapter)
    k_tiles = tl.cdiv(K, BLOCK_F)
    offs_r = tl.arange(0, BLOCK_R)
    rows = (row0 + offs_r).to(tl.int64)
    if tile < k_tiles:  # dA: dh^T x, partial columns [0, K)
        f0 = tile * BLOCK_F
        acc = _chunk_product(dh_ptr, x_ptr, start, end, rank, f0, K, stride_dht, stride_dhr,
                             stride_xt, stride_xk, INTERPRETER, BLOCK_T, BLOCK_F, BLOCK_R)  # fmt: skip
        offs_f = f0 + tl.arange(0, BLOCK_F)
        store_tile(part_ptr, acc, rows, offs_f, stride_pr, stride_pf, offs_r < rank, offs_f < K)
    else:  # dB^T: h^T dy (scaled in pass 2), partial columns [K, K + N)
        f0 = (tile - k_tiles) * BLOCK_F
        acc = _chunk_product(h_ptr, dy_ptr, start, end, rank, f0, N, stride_ht, stride_hr,
                             stride_dyt, stride_dyn, INTERPRETER, BLOCK_T, BLOCK_F, BLOCK_R)  # fmt: skip
        offs_f = f0 + tl.arange(0, BLOCK_F)
        store_tile(part_ptr, acc, rows, K + offs_f, stride_pr, stride_pf, offs_r < rank,
                   offs_f < N)  # fmt: skip


@triton.jit
def _reduce_kernel(
    part_ptr, da_ptr, db_ptr, adapter_ptr, meta_ptr, scale_ptr, num_adapters, K, N, stride_pr,
    stride_pf, stride_dar, stride_dak, stride_dbn, stride_dbr,
    BLOCK_F: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    adapter = tl.program_id(0)
    tile = tl.program_id(1)
    rank = tl.load(meta_ptr + 2 * num_adapters + adapter)
    rank_offset = tl.load(meta_ptr + 3 * num_adapters + adapter)
    row0 = tl.load(adapter_ptr + adapter)
    count = tl.load(adapter_ptr + num_adapters + adapter)
    k_tiles = tl.cdiv(K, BLOCK_F)
    is_da = tile < k_tiles
    f0 = tl.where(is_da, tile, tile - k_tiles) * BLOCK_F
    limit = tl.where(is_da, K, N)
    col0 = tl.where(is_da, 0, K)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank
    offs_f = f0 + tl.arange(0, BLOCK_F)
    mask_f = offs_f < limit
    acc = tl.zeros((BLOCK_R, BLOCK_F), dtype=tl.float32)
    for c in range(0, count):  # chunk order: the same sum on every run
        rows = (row0 + c * rank + offs_r).to(tl.int64)
        acc += load_tile(part_ptr, rows, col0 + offs_f, stride_pr, stride_pf, mask_r, mask_f)
    rows_out = (rank_offset + offs_r).to(tl.int64)
    if is_da:
        store_tile(da_ptr, acc, rows_out, offs_f, stride_dar, stride_dak, mask_r, mask_f)
    else:
        acc = acc * tl.load(scale_ptr + adapter)
        store_tile(db_ptr, acc, rows_out, offs_f, stride_dbr, stride_dbn, mask_r, mask_f)


_PARTIAL_CONFIGS = [
    triton.Config({"BLOCK_T": 64, "BLOCK_F": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_T": 64, "BLOCK_F": 128}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_T": 128, "BLOCK_F": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_T": 128, "BLOCK_F": 128}, num_warps=8, num_stages=3),
]
_PARTIAL = _launch.autotuned(_partial_kernel, _PARTIAL_CONFIGS, key=["K", "N", "num_chunks"])
_PARTIAL_INTERPRETED = triton.Config({"BLOCK_T": 32, "BLOCK_F": 64})
# Pass 2 reads the partial buffer (~(T / chunk) x mean rank x (K + N) x 4 bytes): one tile.
_REDUCE_TILE = {"BLOCK_F": 64}


def lora_wgrad_split(
    dh: torch.Tensor,
    x: torch.Tensor,
    h: torch.Tensor,
    dy: torch.Tensor,
    layout: MultiLoraLayout,
    *,
    out_dtype: torch.dtype | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
    db_like: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(dA, dB)`: `dA_i = dh_i^T x_i` (`[sum r, K]`) and `dB_i = s_i dy_i^T h_i`
    (`[N, sum r]`), each summed over adapter i's tokens only, in two launches for all
    adapters (split over chunks of `chunk_tokens` tokens, then reduced in chunk order).

    dh, h: `[T, >= max_rank]`; x: `[T, K]`; dy: `[T, N]`. Adapters without tokens get zeros.
    db_like: a `[N, sum r]` tensor whose strides dB takes (e.g. a transposed view of a
    packed B^T, so its gradient needs no transposing copy); default contiguous.
    """
    _launch.check_operands("lora_wgrad_split", layout, dh, x, h, dy)
    _launch.check_fused_rank("lora_wgrad_split", layout)
    t = layout.num_tokens
    k, n = x.shape[1], dy.shape[1]
    if any(v.shape[0] != t for v in (dh, x, h, dy)):
        raise ValueError(f"lora_wgrad_split: every operand needs {t} token rows")
    if min(dh.shape[1], h.shape[1]) < layout.max_rank:
        raise ValueError(f"lora_wgrad_split: dh and h need >= {layout.max_rank} rank columns")
    chunks = layout.token_chunks(chunk_tokens)
    out_dtype = out_dtype or x.dtype
    da = torch.empty(layout.total_rank, k, device=x.device, dtype=out_dtype)
    if db_like is None:
        db = torch.empty(n, layout.total_rank, device=x.device, dtype=out_dtype)
    elif tuple(db_like.shape) != (n, layout.total_rank):
        raise ValueError(
            f"lora_wgrad_split: db_like {tuple(db_like.shape)} is not (N {n}, sum of ranks "
            f"{layout.total_rank})"
        )
    else:
        db = torch.empty_like(db_like, dtype=out_dtype, device=x.device)
    part = torch.empty(max(chunks.partial_rows, 1), k + n, device=x.device, dtype=torch.float32)
    block_r = _launch.block_r(layout.max_rank)
    if chunks.num_chunks:

        def grid(meta):
            f = meta["BLOCK_F"]
            return (chunks.num_chunks, _launch.cdiv(k, f) + _launch.cdiv(n, f))

        _launch.launch(
            _PARTIAL,
            x.device,
            grid,
            (_PARTIAL_INTERPRETED, _PARTIAL_CONFIGS[0]),
            (dh, x, h, dy, part, chunks.chunk_meta, layout.meta, chunks.num_chunks,
             layout.num_adapters, k, n, *dh.stride(), *x.stride(), *h.stride(), *dy.stride(),
             *part.stride()),
            BLOCK_R=block_r,
        )  # fmt: skip
    f = _REDUCE_TILE["BLOCK_F"]
    _reduce_kernel[(layout.num_adapters, _launch.cdiv(k, f) + _launch.cdiv(n, f))](
        part, da, db, chunks.adapter_meta, layout.meta, layout.scale_tensor, layout.num_adapters,
        k, n, *part.stride(), *da.stride(), *db.stride(), BLOCK_F=f, BLOCK_R=block_r,
    )  # fmt: skip
    return da, db


def lora_wgrad_split_reference(
    dh: torch.Tensor,
    x: torch.Tensor,
    h: torch.Tensor,
    dy: torch.Tensor,
    layout: MultiLoraLayout,
    *,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    da = torch.zeros(layout.total_rank, x.shape[1], device=x.device)
    db = torch.zeros(dy.shape[1], layout.total_rank, device=x.device)
    for i in range(layout.num_adapters):
        s, e, r, o = layout.segment(i)
        da[o : o + r] = dh[s:e, :r].float().t() @ x[s:e].float()
        db[:, o : o + r] = (dy[s:e].float().t() @ h[s:e, :r].float()) * layout.scales[i]
    out_dtype = out_dtype or x.dtype
    return da.to(out_dtype), db.to(out_dtype)
