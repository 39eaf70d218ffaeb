"""Compile representative kernels for sm_90 (Hopper) without a GPU; run by test_compiles_for_hopper.

Prints one line per kernel and exits non-zero if any fails. Run without TRITON_INTERPRET:
the kernels must be real `triton.jit` functions here.
"""

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from loka.kernels import fp8_gemm, fp8_gemm_tma, grouped_gemm, norm_quantization, quantization
from loka.kernels import transpose_quantization as tq

TARGET = GPUTarget("cuda", 90, 32)
ALIGNED = ("a_ptr", "b_ptr", "c_ptr", "x_ptr", "q_ptr", "qt_ptr", "y_ptr", "K", "N", "C", "R",
           "stride_am", "stride_bn", "stride_cm", "stride_r", "stride_x")  # fmt: skip


def build(fn, types: dict, const: dict, warps: int, stages: int = 3):
    sig = {a: "constexpr" if a in const else types.get(a, "i32") for a in fn.arg_names}
    attrs = {
        (fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in ALIGNED if a in fn.arg_names
    }
    src = ASTSource(fn, sig, const, attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": warps, "num_stages": stages})


def main() -> int:
    f32 = "*fp32"
    cases = [
        ("fp8_gemm row e5m2xe4m3", fp8_gemm._fp8_gemm_kernel,
         dict(a_ptr="*fp8e5", b_ptr="*fp8e4nv", c_ptr="*bf16", a_scale_ptr=f32, b_scale_ptr=f32, bias_ptr="*bf16"),
         dict(A_SCALE=1, B_SCALE=1, A_BLOCK_ROWS=1, B_BLOCK_ROWS=1, HAS_BIAS=True, ACTIVATION=2, FAST_ACCUM=False,
              SOFT_FP8=False, A_FMT=1, B_FMT=0, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8), 8, True),
        ("fp8_gemm block", fp8_gemm._fp8_gemm_kernel,
         dict(a_ptr="*fp8e4nv", b_ptr="*fp8e4nv", c_ptr="*fp32", a_scale_ptr=f32, b_scale_ptr=f32, bias_ptr=f32),
         dict(A_SCALE=2, B_SCALE=2, A_BLOCK_ROWS=1, B_BLOCK_ROWS=128, HAS_BIAS=False, ACTIVATION=0, FAST_ACCUM=False,
              SOFT_FP8=False, A_FMT=0, B_FMT=0, BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8), 8, True),
        ("fp8_gemm_tma", fp8_gemm_tma._fp8_gemm_tma_kernel,
         dict(a_desc="tensordesc<fp8e4nv[128, 128]>", b_desc="tensordesc<fp8e4nv[128, 128]>",
              c_desc="tensordesc<bf16[128, 128]>", a_scale_ptr=f32, b_scale_ptr=f32, bias_ptr="*bf16"),
         dict(A_SCALE=1, B_SCALE=1, HAS_BIAS=True, ACTIVATION=3, FAST_ACCUM=False, SOFT_FP8=False, A_FMT=0,
              B_FMT=0, NUM_SMS=132, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8), 8, False),
        ("quantize rows", quantization._quantize_groups_kernel,
         dict(x_ptr="*bf16", q_ptr="*fp8e4nv", amax_in_ptr=f32, amax_ptr=f32, scale_ptr=f32, inv_ptr=f32, scale_ub="fp32"),
         dict(FMT=0, SOFT_FP8=False, POW2=True, HAS_UB=True, HAS_AMAX_IN=False, WHOLE_TILE=False, BLOCK_R=1,
              BLOCK_C=8192, LOOP_C=False), 8, False),
        ("quantize tensor", quantization._quantize_tensor_kernel,
         dict(x_ptr="*bf16", q_ptr="*fp8e5", amax_in_ptr=f32, amax_ptr=f32, scale_ptr=f32, inv_ptr=f32, scale_ub="fp32"),
         dict(FMT=1, SOFT_FP8=False, POW2=False, HAS_UB=False, DELAYED=False, PARTIALS=1024, BLOCK_R=4,
              BLOCK_C=1024), 8, False),
        ("amax partials", quantization._amax_partials_kernel, dict(x_ptr="*bf16", amax_ptr=f32),
         dict(BLOCK_R=4, BLOCK_C=1024), 8, False),
        ("row and column amax", tq._row_col_amax_kernel, dict(x_ptr="*bf16", amax_ptr=f32),
         dict(BLOCK_R=256, BLOCK_C=128), 8, False),
        ("transpose-quantize row", tq._transpose_quantize_kernel,
         {**{k: f32 for k in tq._transpose_quantize_kernel.arg_names if k.endswith("_ptr")},
          "x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "qt_ptr": "*fp8e4nv", "scale_ub": "fp32"},
         dict(MODE=1, FMT=0, SOFT_FP8=False, POW2=False, HAS_UB=False, DELAYED=False, PARTIALS=1, BLOCK_R=32,
              BLOCK_C=128), 4, False),
        ("layernorm+quantize", norm_quantization._norm_quantize_kernel,
         {**{k: f32 for k in norm_quantization._norm_quantize_kernel.arg_names if k.endswith("_ptr")},
          "x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "q_ptr": "*fp8e4nv", "y_ptr": "*bf16", "eps": "fp32", "scale_ub": "fp32"},
         dict(RMS=False, HAS_W=True, HAS_B=True, WRITE_Y=True, FMT=0, SOFT_FP8=False, POW2=False, HAS_UB=False,
              BLOCK_M=4, BLOCK_N=1024), 8, False),
        ("grouped fp8 row", grouped_gemm._grouped_gemm_kernel, dict(meta_ptr="*i64"),
         dict(A_KIND=3, B_KIND=3, C_KIND=0, BIAS_KIND=0, SCALE=2, HAS_BIAS=True, ACTIVATION=1, SOFT_FP8=False,
              G_POW2=32, ALIGNED=True, C_ALIGNED=True, UNIFORM=False, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64), 8,
         False),
        ("grouped bf16 uniform", grouped_gemm._grouped_gemm_kernel, dict(meta_ptr="*i64"),
         dict(A_KIND=0, B_KIND=0, C_KIND=0, BIAS_KIND=0, SCALE=0, HAS_BIAS=False, ACTIVATION=0, SOFT_FP8=False,
              G_POW2=32, ALIGNED=True, C_ALIGNED=True, UNIFORM=True, BLOCK_M=128, BLOCK_N=64, BLOCK_K=64), 4,
         False),
    ]  # fmt: skip
    failed = 0
    for name, fn, types, const, warps, must_pipeline in cases:
        try:
            kernel = build(fn, types, const, warps, stages=4 if must_pipeline else 3)
            ttgir = kernel.asm["ttgir"]
            dots = ttgir.count("warp_group_dot ")
            copies = ttgir.count("async_copy_global_to_local")
            if must_pipeline and not (dots and copies):
                raise AssertionError(
                    f"not pipelined onto wgmma (wgmma={dots}, async copies={copies})"
                )
            print(f"OK {name}: shared={kernel.metadata.shared} wgmma={dots} async_copies={copies}")
        except Exception as exc:  # report every kernel, then fail
            failed += 1
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[:2000]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
