"""The fused multi-LoRA kernels (forward, dh/dx, split wgrad) against their pure-torch
references and against the unfused kernels, in Triton's interpreter on CPU; and the sm_90
compile of each (no GPU needed)."""

import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates the kernels

import pytest
import torch

from loka.plora.kernels import (
    MultiLoraLayout,
    lora_backward_data,
    lora_backward_data_reference,
    lora_forward,
    lora_forward_reference,
    lora_wgrad_split,
    lora_wgrad_split_reference,
    multi_lora_base_linear,
    multi_lora_kernels_available,
    multi_lora_linear,
    multi_lora_linear_reference,
)
from loka.plora.kernels.function import resolve_path

if not multi_lora_kernels_available("cpu"):
    pytest.skip(
        "loka.plora.kernels was imported before TRITON_INTERPRET=1 was set",
        allow_module_level=True,
    )

DEVICE = "cpu"
# Uneven segments (one of several wgrad chunks, one of a single token), an adapter without
# tokens, mixed ranks (one above a 16-wide rank tile).
TOKENS = (5, 0, 37, 1)
RANKS = (4, 8, 20, 16)
ALPHAS = (8.0, 16.0, 5.0, 16.0)
K, N = 144, 160  # two 128-feature groups each, several interpreter tiles
CHUNK = 16  # wgrad chunk: the 37-token adapter is split in three
TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


def _layout(tokens=TOKENS, ranks=RANKS, alphas=ALPHAS) -> MultiLoraLayout:
    scales = [a / r for a, r in zip(alphas, ranks, strict=True)]
    return MultiLoraLayout.from_token_counts(tokens, ranks, scales, device=DEVICE)


def _operands(layout, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    t, r = layout.num_tokens, layout.total_rank
    x = torch.randn(t, K, generator=g)
    a_cat = torch.randn(r, K, generator=g) / K**0.5
    b_cat = torch.randn(N, r, generator=g) / 4
    base = torch.randn(t, N, generator=g)
    dy = torch.randn(t, N, generator=g)
    return [v.to(DEVICE, dtype) for v in (x, a_cat, b_cat, base, dy)]


def _close(actual, expected, dtype):
    scale = expected.float().abs().max().clamp_min(1.0)
    err = (actual.float() - expected.float()).abs().max() / scale
    assert err <= TOL[dtype], f"relative error {err:.3g} > {TOL[dtype]}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups", [1, 2])
def test_fused_kernels_match_references(dtype, groups):
    layout = _layout()
    x, a_cat, b_cat, base, dy = _operands(layout, dtype)
    y, h = lora_forward(x, a_cat, b_cat, base, layout, groups=groups)
    y_ref, h_ref = lora_forward_reference(x, a_cat, b_cat, base, layout)
    _close(h, h_ref, dtype)
    _close(y, y_ref, dtype)
    dx, dh = lora_backward_data(dy, a_cat, b_cat, layout, groups=groups)
    dx_ref, dh_ref = lora_backward_data_reference(dy, a_cat, b_cat, layout)
    _close(dh, dh_ref, dtype)
    _close(dx, dx_ref, dtype)
    assert h.dtype == dh.dtype == y.dtype == dx.dtype == dtype
    assert torch.all(h[:, 4:][:5] == 0) and torch.all(dh[:, 4:][:5] == 0)  # past rank: zeros
    da, db = lora_wgrad_split(dh_ref, x, h_ref, dy, layout, chunk_tokens=CHUNK)
    da_ref, db_ref = lora_wgrad_split_reference(dh_ref, x, h_ref, dy, layout)
    _close(da, da_ref, dtype)
    _close(db, db_ref, dtype)
    o, r = layout.rank_offsets[1], layout.ranks[1]  # the adapter without tokens
    assert torch.all(da[o : o + r] == 0) and torch.all(db[:, o : o + r] == 0)


@pytest.mark.parametrize("chunk", [1, 16, 4096])
def test_split_wgrad_is_the_same_for_any_chunk_size(chunk):
    layout = _layout()
    x, a_cat, b_cat, base, dy = _operands(layout, torch.float32, seed=1)
    _, h = lora_forward_reference(x, a_cat, b_cat, base, layout)
    _, dh = lora_backward_data_reference(dy, a_cat, b_cat, layout)
    da, db = lora_wgrad_split(dh, x, h, dy, layout, chunk_tokens=chunk, out_dtype=torch.bfloat16)
    da_ref, db_ref = lora_wgrad_split_reference(dh, x, h, dy, layout, out_dtype=torch.float32)
    assert da.dtype == db.dtype == torch.bfloat16
    _close(da, da_ref, torch.bfloat16)
    _close(db, db_ref, torch.bfloat16)


def test_split_wgrad_writes_db_in_the_strides_it_is_given():
    """A packed B^T ([sum r, N]) is read as its transpose; its gradient comes out in the
    same strides, so autograd hands it to the packed parameter without a transposing copy."""
    layout = _layout()
    x, a_cat, b_cat, base, dy = _operands(layout, torch.float32, seed=2)
    _, h = lora_forward_reference(x, a_cat, b_cat, base, layout)
    _, dh = lora_backward_data_reference(dy, a_cat, b_cat, layout)
    b_like = b_cat.t().contiguous().t()  # [N, sum r] with strides (1, N)
    da, db = lora_wgrad_split(dh, x, h, dy, layout, db_like=b_like)
    assert db.stride() == b_like.stride() and db.t().is_contiguous()
    da_ref, db_ref = lora_wgrad_split_reference(dh, x, h, dy, layout)
    _close(da, da_ref, torch.float32)
    _close(db, db_ref, torch.float32)
    with pytest.raises(ValueError, match="db_like"):
        lora_wgrad_split(dh, x, h, dy, layout, db_like=b_like[:, :-1])


def test_token_chunks_cut_each_segment_in_adapter_order():
    layout = MultiLoraLayout.from_segments((9, 0, 9), (12, 9, 9), (2, 3, 5), (1.0, 1.0, 1.0))
    chunks = layout.token_chunks(4)
    assert layout.token_chunks(4) is chunks  # cached: the layout serves every layer
    assert chunks.chunk_meta.tolist() == [[0, 1, 1, 1], [9, 0, 4, 8], [12, 4, 8, 9], [0, 2, 5, 8]]
    assert chunks.adapter_meta.tolist() == [[0, 2, 11], [1, 3, 0]]
    assert (chunks.num_chunks, chunks.partial_rows) == (4, 11)
    with pytest.raises(ValueError, match="chunk_tokens"):
        layout.token_chunks(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_op_equals_unfused_op_and_the_loop(dtype):
    layout = _layout()
    x, a_cat, b_cat, base, dy = _operands(layout, dtype, seed=2)
    grads = {}
    for path in ("fused", "unfused"):
        leaves = [v.clone().requires_grad_() for v in (x, base, a_cat, b_cat)]
        y = multi_lora_linear(*leaves, layout, path=path)
        y.backward(dy)
        grads[path] = [y.detach(), *(v.grad for v in leaves)]
    leaves = [v.clone().float().requires_grad_() for v in (x, base, a_cat, b_cat)]
    splits = list(zip(layout.rank_offsets, layout.ranks, strict=True))
    y = multi_lora_linear_reference(
        leaves[0], leaves[1], [leaves[2][o : o + r] for o, r in splits],
        [leaves[3][:, o : o + r] for o, r in splits], layout,
    )  # fmt: skip
    y.backward(dy.float())
    want = [y.detach(), *(v.grad for v in leaves)]
    for got_fused, got_unfused, ref in zip(grads["fused"], grads["unfused"], want, strict=True):
        _close(got_fused, ref, dtype)
        _close(got_unfused, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_base_linear_op_equals_base_then_adapters(dtype):
    """multi_lora_base_linear (adapters added in place into the base GEMM's output and input
    gradient) against F.linear + the loop over adapters, bias and weight gradients included."""
    layout = _layout()
    x, a_cat, b_cat, _, dy = _operands(layout, dtype, seed=5)
    g = torch.Generator().manual_seed(6)
    weight = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype)
    leaves = [v.clone().requires_grad_() for v in (x, weight, bias, a_cat, b_cat)]
    y = multi_lora_base_linear(*leaves, layout)
    y.backward(dy)
    ref = [v.clone().float().requires_grad_() for v in (x, weight, bias, a_cat, b_cat)]
    splits = list(zip(layout.rank_offsets, layout.ranks, strict=True))
    y_ref = multi_lora_linear_reference(
        ref[0], torch.nn.functional.linear(ref[0], ref[1], ref[2]),
        [ref[3][o : o + r] for o, r in splits], [ref[4][:, o : o + r] for o, r in splits], layout,
    )  # fmt: skip
    y_ref.backward(dy.float())
    _close(y, y_ref, dtype)
    for got, want in zip(leaves, ref, strict=True):
        _close(got.grad, want.grad, dtype)
    # Frozen base, no bias, x without gradient: only the adapters' gradients.
    a2, b2 = a_cat.clone().requires_grad_(), b_cat.clone().requires_grad_()
    multi_lora_base_linear(x, weight, None, a2, b2, layout).backward(dy)
    _close(a2.grad, ref[3].grad, dtype)
    _close(b2.grad, ref[4].grad, dtype)


def test_base_linear_op_takes_float32_packed_factors_with_no_autograd_nodes_of_its_own():
    """Float32 packed factors on a bfloat16 input, B as a packed B^T's transpose (as
    PackedLoraLinear passes them): the op casts inside, each factor gets its float32
    gradient in its own strides, and the graph goes from the op straight to the factors'
    gradient accumulators."""
    layout = _layout()
    x, a_cat, b_cat, _, dy = _operands(layout, torch.bfloat16, seed=8)
    g = torch.Generator().manual_seed(9)
    weight = (torch.randn(N, K, generator=g) / K**0.5).to(torch.bfloat16)
    a_packed = a_cat.float().clone().requires_grad_()
    bt_packed = b_cat.float().t().contiguous().requires_grad_()
    y = multi_lora_base_linear(x, weight, None, a_packed, bt_packed.t(), layout)
    accumulators = {f[0].name() for f in y.grad_fn.next_functions if f[0] is not None}
    assert accumulators <= {"torch::autograd::AccumulateGrad", "TBackward0"}
    y.backward(dy)
    a_ref = a_packed.detach().clone().requires_grad_()
    b_ref = bt_packed.detach().t().clone().requires_grad_()
    want = multi_lora_base_linear(x, weight, None, a_ref.to(torch.bfloat16),
                                  b_ref.to(torch.bfloat16), layout)  # fmt: skip
    want.backward(dy)
    _close(y, want, torch.bfloat16)
    for got, ref in ((a_packed.grad, a_ref.grad), (bt_packed.grad, b_ref.grad.t())):
        assert got.dtype == torch.float32 and got.is_contiguous()
        _close(got, ref, torch.bfloat16)
    with pytest.raises(TypeError, match="share one dtype"):
        multi_lora_base_linear(x, weight, None, a_packed, bt_packed.t().double(), layout)


def test_backward_data_accumulates_into_the_base_input_gradient():
    layout = _layout()
    x, a_cat, b_cat, base, dy = _operands(layout, torch.float32, seed=7)
    into = torch.randn(layout.num_tokens, K)
    want = into + lora_backward_data_reference(dy, a_cat, b_cat, layout)[0]
    dx, _ = lora_backward_data(dy, a_cat, b_cat, layout, accumulate_into=into, groups=2)
    assert dx is into
    _close(into, want, torch.float32)
    with pytest.raises(ValueError, match="accumulate_into"):
        lora_backward_data(dy, a_cat, b_cat, layout, need_dx=False, accumulate_into=into)
    y, _ = lora_forward(x, a_cat, b_cat, base, layout, out=base)  # in place into base
    assert y is base


@pytest.fixture
def gpu_tuning(monkeypatch):
    """The GPU's launch path in the interpreter: every kernel goes through its autotuner,
    which runs each of two configs three times (a stand-in for the benchmark) before the
    winner runs: what `triton.autotune` does to arguments on the first call of a shape."""
    import triton

    from loka.plora.kernels import _launch, fused_backward, fused_forward

    def bench(fn, quantiles=None, **_):
        for _ in range(3):
            fn()
        return [1.0, 1.0, 1.0]

    for pair in (fused_forward._FORWARD, fused_backward._BACKWARD):
        tuner = pair[1]
        small = [triton.Config(dict(c.kwargs), num_warps=c.num_warps) for c in tuner.configs[:2]]
        monkeypatch.setattr(tuner, "configs", small)
        monkeypatch.setitem(tuner.__dict__, "do_bench", bench)  # a cached_property
        monkeypatch.setattr(tuner, "cache", {})

    def launch(pair, device, grid, tiles, args, **constexprs):
        pair[1][grid](*args, **constexprs, INTERPRETER=True)

    monkeypatch.setattr(_launch, "launch", launch)


def test_tuning_leaves_in_place_outputs_as_one_run_would(gpu_tuning):
    # The H200 bench found dx of multi_lora_base_linear 336x off: the tuner's repeated
    # runs of the accumulating backward each added the adapters' term into dx.
    layout = _layout()
    x, a_cat, b_cat, base, dy = _operands(layout, torch.float32, seed=3)
    into = torch.randn(layout.num_tokens, K)
    want = into + lora_backward_data_reference(dy, a_cat, b_cat, layout)[0]
    dx, _ = lora_backward_data(dy, a_cat, b_cat, layout, accumulate_into=into, groups=2)
    _close(dx, want, torch.float32)
    want_y = lora_forward_reference(x, a_cat, b_cat, base, layout)[0]
    y, _ = lora_forward(x, a_cat, b_cat, base, layout, out=base)  # base read and written
    assert y is base
    _close(y, want_y, torch.float32)


def test_fused_backward_without_input_gradient_and_nan_isolation():
    # Adapter 1's tokens first; a NaN in adapter 0's input stays in adapter 0.
    layout = MultiLoraLayout.from_segments((6, 0), (11, 6), (8, 4), (2.0, 1.0))
    g = torch.Generator().manual_seed(4)
    x = torch.randn(11, K, generator=g)
    x[7, 3] = float("nan")
    a_cat = (torch.randn(12, K, generator=g) / K**0.5).requires_grad_()
    b_cat = torch.randn(N, 12, generator=g).requires_grad_()
    y = multi_lora_linear(x, torch.zeros(11, N), a_cat, b_cat, layout, path="fused")
    y.sum().backward()  # x needs no gradient: the kernel skips dx
    assert torch.isnan(y[6:]).any() and torch.isfinite(y[:6]).all()
    assert torch.isfinite(a_cat.grad[8:]).all() and torch.isfinite(b_cat.grad[:, 8:]).all()
    assert torch.isnan(a_cat.grad[:8]).any()
    dx, dh = lora_backward_data(torch.ones(11, N), a_cat.detach(), b_cat.detach(), layout,
                                need_dx=False)  # fmt: skip
    assert dx is None and dh.shape == (11, 8)


def test_kernel_path_selection(monkeypatch):
    layout = _layout()
    monkeypatch.delenv("LOKA_PLORA_KERNELS", raising=False)
    assert resolve_path(None, layout) == "fused"
    assert resolve_path("unfused", layout) == "unfused"
    monkeypatch.setenv("LOKA_PLORA_KERNELS", "unfused")
    assert resolve_path(None, layout) == "unfused"
    assert resolve_path("fused", layout) == "fused"
    with pytest.raises(ValueError, match="path must be one of"):
        resolve_path("fast", layout)
    wide = _layout(tokens=(3, 2), ranks=(256, 8), alphas=(16.0, 16.0))
    assert resolve_path("fused", wide) == "unfused"  # rank beyond the fused rank tile
    x, a_cat, b_cat, base, _ = _operands(wide, torch.float32)
    with pytest.raises(ValueError, match="max rank 256"):
        lora_forward(x, a_cat, b_cat, base, wide)


_COMPILE_FOR_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from loka.plora.kernels import fused_backward, fused_forward, wgrad_split

INTS = ("meta_ptr", "chunk_ptr", "adapter_ptr")


def build(fn, dtype, const, ones):
    const = {**const, **{a: 1 for a in ones}}  # unit strides: Triton specializes them
    sig = {a: "constexpr" if a in const else "*i32" if a in INTS
           else "*fp32" if a in ("part_ptr", "scale_ptr") else dtype if a.endswith("_ptr")
           else "i32" for a in fn.arg_names}
    triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 4, "num_stages": 3})


tiles = dict(INTERPRETER=False, BLOCK_T=64, BLOCK_K=64, BLOCK_N=64)
for dt in ("*bf16", "*fp32"):
    build(fused_forward._forward_kernel, dt, dict(tiles, BLOCK_R=64),
          ("stride_xk", "stride_ak", "stride_br", "stride_bbn", "stride_yn", "stride_hr"))
    for has_dx, accumulate in ((True, False), (True, True), (False, False)):
        build(fused_backward._backward_data_kernel, dt,
              dict(tiles, HAS_DX=has_dx, ACCUMULATE=accumulate, BLOCK_R=32),
              ("stride_dyn", "stride_ak", "stride_br", "stride_dxk", "stride_dhr"))
    build(wgrad_split._partial_kernel, dt,
          dict(INTERPRETER=False, BLOCK_T=64, BLOCK_F=128, BLOCK_R=64),
          ("stride_dhr", "stride_xk", "stride_hr", "stride_dyn", "stride_pf"))
    build(wgrad_split._reduce_kernel, dt, dict(BLOCK_F=64, BLOCK_R=16),
          ("stride_pf", "stride_dak", "stride_dbr"))
    print("OK", dt)
"""


def test_fused_kernels_compile_for_hopper():
    """What only the compiler sees (types, lowering), without a GPU: a subprocess, since
    this session's kernels run in the interpreter."""
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton build ships no ptxas to compile with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_FOR_SM90], env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["OK", "*bf16", "OK", "*fp32"]
