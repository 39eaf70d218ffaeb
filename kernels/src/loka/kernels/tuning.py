"""The tiles the kernels launch without autotuning, read and set at run time.

The defaults in the kernel modules were measured on an H200 (`bench/kernels.py --sections
tune`); a sweep on another GPU sets its own through `set_tiles`, which also drops the launch
plans cached for the old tiles, so the next call compiles the new ones.

    before = tiles()                    # every knob, JSON-ready
    set_tiles(gemm={"plain": (128, 128, 128, 8, 4)}, grouped=(128, 64, 64, 4, 3))
    with launch_cache(False): ...       # Triton's own launch path, e.g. to time what it costs
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from loka.kernels import fp8_gemm, fp8_gemm_tma, grouped_gemm, launch, quantization
from loka.kernels import transpose_quantization as tq

__all__ = ["KNOBS", "launch_cache", "set_tiles", "tiles"]

Tile = tuple[int, int, int, int, int]  # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages

KNOBS = {
    "quantize_rows": "row quantization: {'elements': per program, 'warps': None (by size) or n}",
    "transpose": "transpose-quantization: {'quantize': (R, C), 'warps', 'block_warps', 'amax'}",
    "gemm": "Triton FP8 GEMM by accumulation: {'plain' | 'fast' | 'block': Tile}",
    "gemm_tma": "TMA FP8 GEMM by fast accumulation: {False | True: Tile}",
    "grouped": "grouped GEMM: Tile",
    "row_block_scales_transposed": "1x128-block scales of wgrad read K-block-major (bool)",
}


def tiles() -> dict[str, object]:
    """Every knob's current value (copies; `gemm_tma`'s keys as "False"/"True" strings)."""
    return {
        "quantize_rows": dict(quantization.ROW_TILE),
        "transpose": dict(tq.TILES),
        "gemm": dict(fp8_gemm.HEURISTIC_TILES),
        "gemm_tma": {str(k): v for k, v in fp8_gemm_tma.DEFAULT_TILES.items()},
        "grouped": grouped_gemm.HEURISTIC_TILE,
        "row_block_scales_transposed": fp8_gemm.TRANSPOSE_ROW_BLOCK_SCALES,
    }


def _update(target: dict, values: Mapping, knob: str) -> None:
    unknown = set(values) - set(target)
    if unknown:
        raise ValueError(f"set_tiles({knob}=...): unknown keys {sorted(map(str, unknown))}")
    target.update(values)


def set_tiles(
    *,
    quantize_rows: Mapping[str, int | None] | None = None,
    transpose: Mapping[str, object] | None = None,
    gemm: Mapping[str, Tile] | None = None,
    gemm_tma: Mapping[bool, Tile] | None = None,
    grouped: Tile | None = None,
    row_block_scales_transposed: bool | None = None,
) -> None:
    """Set the given knobs (see `KNOBS`; a mapping updates only its keys) and drop the
    launch plans that were cached for the old values."""
    if quantize_rows is not None:
        _update(quantization.ROW_TILE, quantize_rows, "quantize_rows")
        quantization._group_tiles.cache_clear()
        quantization._QUANTIZE_GROUPS._plans.clear()
    if transpose is not None:
        _update(tq.TILES, transpose, "transpose")
        tq._TRANSPOSE_QUANTIZE._plans.clear()
        tq._ROW_COL_AMAX._plans.clear()
    if gemm is not None:
        _update(fp8_gemm.HEURISTIC_TILES, gemm, "gemm")
    if gemm_tma is not None:
        _update(fp8_gemm_tma.DEFAULT_TILES, gemm_tma, "gemm_tma")
        fp8_gemm_tma._TMA._plans.clear()
    if grouped is not None:
        grouped_gemm.HEURISTIC_TILE = tuple(grouped)
    if row_block_scales_transposed is not None:
        fp8_gemm.TRANSPOSE_ROW_BLOCK_SCALES = bool(row_block_scales_transposed)
    if gemm is not None or row_block_scales_transposed is not None:
        fp8_gemm._FP8_GEMM._plans.clear()


@contextmanager
def launch_cache(enabled: bool) -> Iterator[None]:
    """Within the block, kernels launch from their cached plans (True, the default) or take
    Triton's own launch path every call (False)."""
    before = launch.ENABLED
    launch.ENABLED = enabled
    try:
        yield
    finally:
        launch.ENABLED = before
