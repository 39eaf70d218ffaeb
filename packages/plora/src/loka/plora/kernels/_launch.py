"""Host side shared by the segmented launchers: operand checks, tiles, launching."""

from __future__ import annotations

import torch
import triton

from loka.kernels.runtime import autotuning, require_triton_device
from loka.plora.kernels._tiles import mma
from loka.plora.kernels.layout import MultiLoraLayout

MAX_BLOCK_R = 128
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def block_r(max_rank: int) -> int:
    return max(16, min(MAX_BLOCK_R, triton.next_power_of_2(max_rank)))


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


def autotuned(kernel, configs: list[triton.Config], key: list[str]):
    """The plain kernel (interpreter, heuristic tile) and its autotuned wrapper (GPU)."""
    return kernel, triton.autotune(configs=configs, key=key)(kernel)


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
