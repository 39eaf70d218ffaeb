"""Host side shared by the segmented launchers: operand checks, tiles, launching."""

from __future__ import annotations

import torch
import triton

from loka.kernels.runtime import autotuning, require_triton_device
from loka.plora.kernels._tiles import mma
from loka.plora.kernels.layout import MultiLoraLayout

MAX_BLOCK_R = 128
# The fused kernels hold an adapter's whole rank in one tile (h, dh in registers).
MAX_FUSED_RANK = MAX_BLOCK_R
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Programs a fused launch aims for before it splits the feature tiles into groups: a few
# per SM of an H100/H200 (132 SMs). A large packed batch has more token blocks than this.
TARGET_PROGRAMS = 512
GROUP_UNIT = 128  # a group's features: a multiple of every BLOCK_N / BLOCK_K in the configs


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_r(max_rank: int) -> int:
    return max(16, min(MAX_BLOCK_R, 1 << (max_rank - 1).bit_length()))


def check_fused_rank(name: str, layout: MultiLoraLayout) -> None:
    if layout.max_rank > MAX_FUSED_RANK:
        raise ValueError(
            f"{name}: max rank {layout.max_rank} > {MAX_FUSED_RANK}, the fused kernels' rank "
            "tile; use the unfused kernels (multi_lora_linear(..., path='unfused'))"
        )


def split_groups(layout: MultiLoraLayout, features: int, groups: int | None) -> tuple[int, int]:
    """(group count, features per group) for a fused kernel's feature loop: one group when
    the token blocks alone fill the GPU, else enough groups to reach TARGET_PROGRAMS (each
    group recomputes the rank-side product, re-reading its input once)."""
    units = cdiv(features, GROUP_UNIT)
    if groups is None:
        groups = cdiv(TARGET_PROGRAMS, max(layout.token_blocks, 1))
    groups = max(1, min(int(groups), units))
    per_group = cdiv(units, groups) * GROUP_UNIT
    return cdiv(features, per_group), per_group


def multi_lora_kernels_available(device: torch.device | str) -> bool:
    """Whether the kernels can run on `device`: a CUDA GPU, or the CPU when Triton built
    them for its interpreter (TRITON_INTERPRET=1 when this module was first imported)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available()
    return device.type == "cpu" and not isinstance(mma, triton.runtime.JITFunction)


def check_operands(name: str, layout: MultiLoraLayout, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype not in SUPPORTED_DTYPES:
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
            f"before loka.plora.kernels is imported; tensors are on {tensors[0].device}"
        )
    if layout.meta.device != tensors[0].device:
        raise ValueError(
            f"{name}: layout is on {layout.meta.device}, tensors on {tensors[0].device}; "
            "build the layout on the tensors' device"
        )


def autotuned(kernel, configs: list[triton.Config], key: list[str], **tuning):
    """The plain kernel (interpreter, heuristic tile) and its autotuned wrapper (GPU);
    `tuning`: more `triton.autotune` arguments (e.g. `restore_value`)."""
    return kernel, triton.autotune(configs=configs, key=key, **tuning)(kernel)


def launch(pair, device: torch.device, grid, tiles, args, **constexprs) -> None:
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
