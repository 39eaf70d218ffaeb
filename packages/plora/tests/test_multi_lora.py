"""Segmented multi-LoRA kernels against their pure-torch references (Triton interpreter on CPU)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates the kernels

import pytest
import torch

from loka.plora.kernels import (
    MultiLoraLayout,
    lora_expand,
    lora_expand_reference,
    lora_shrink,
    lora_shrink_reference,
    lora_wgrad,
    lora_wgrad_reference,
    multi_lora_kernels_available,
    multi_lora_linear,
    multi_lora_linear_reference,
)

if not multi_lora_kernels_available("cpu"):
    pytest.skip(
        "loka.plora.kernels was imported before TRITON_INTERPRET=1 was set",
        allow_module_level=True,
    )

DEVICE = "cpu"  # the tests run the kernels in Triton's interpreter; bench/plora.py on the GPU
# Mixed ranks (one above a 16-wide rank block), one adapter without tokens, odd lengths.
TOKENS = (5, 0, 37, 1)
RANKS = (4, 8, 20, 16)
ALPHAS = (8.0, 16.0, 5.0, 16.0)
K, N = 80, 72  # more than one interpreter tile along K and N
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def _layout(tokens=TOKENS, ranks=RANKS) -> MultiLoraLayout:
    scales = [a / r for a, r in zip(ALPHAS, ranks, strict=True)]
    return MultiLoraLayout.from_token_counts(tokens, ranks, scales, device=DEVICE)


def _factors(layout, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = [torch.randn(r, K, generator=g) / K**0.5 for r in layout.ranks]
    b = [torch.randn(N, r, generator=g) / r**0.5 for r in layout.ranks]
    return [t.to(DEVICE, dtype) for t in a], [t.to(DEVICE, dtype) for t in b]


def _close(actual, expected, dtype):
    scale = expected.float().abs().max().clamp_min(1.0)
    err = (actual.float() - expected.float()).abs().max() / scale
    assert err <= TOL[dtype], f"relative error {err:.3g} > {TOL[dtype]}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_shrink_expand_wgrad_match_references(dtype):
    layout = _layout()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(layout.num_tokens, K, generator=g).to(DEVICE, dtype)
    dy = torch.randn(layout.num_tokens, N, generator=g).to(DEVICE, dtype)
    base = torch.randn(layout.num_tokens, N, generator=g).to(DEVICE, dtype)
    a, b = _factors(layout, dtype)
    a_cat, b_cat = torch.cat(a), torch.cat(b, dim=1)

    h = lora_shrink(x, a_cat, layout)
    _close(h, lora_shrink_reference(x, a_cat, layout), dtype)
    y = lora_expand(h, b_cat, layout, base=base)
    _close(y, lora_expand_reference(h, b_cat, layout, base=base), dtype)
    # The backward's strided operands: b_cat^T and a_cat^T are transposed views.
    dh = lora_shrink(dy, b_cat.t(), layout, scaled=True)
    _close(dh, lora_shrink_reference(dy, b_cat.t(), layout, scaled=True), dtype)
    dx = lora_expand(dh, a_cat.t(), layout, scaled=False)
    _close(dx, lora_expand_reference(dh, a_cat.t(), layout, scaled=False), dtype)
    da = lora_wgrad(dh, x, layout, rank_on_left=True, scaled=False)
    _close(da, lora_wgrad_reference(dh, x, layout, rank_on_left=True, scaled=False), dtype)
    db = lora_wgrad(dy, h, layout, rank_on_left=False, scaled=True)
    _close(db, lora_wgrad_reference(dy, h, layout, rank_on_left=False, scaled=True), dtype)
    # Columns beyond an adapter's rank are zero, and an adapter without tokens gets zeros.
    s, e = layout.token_starts[0], layout.token_ends[0]
    assert torch.all(h[s:e, RANKS[0] :] == 0)
    o1 = layout.rank_offsets[1]
    assert torch.all(da[o1 : o1 + RANKS[1]] == 0) and torch.all(db[:, o1 : o1 + RANKS[1]] == 0)


def test_multi_lora_linear_forward_backward_equal_per_adapter_loop():
    layout = _layout()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(layout.num_tokens, K, generator=g, device="cpu").to(DEVICE)
    base = torch.randn(layout.num_tokens, N, generator=g).to(DEVICE)
    a, b = _factors(layout, torch.float32, seed=3)
    # B starts at zero in LoRA; a nonzero B makes dA and dx meaningful.
    leaves = [t.clone().requires_grad_() for t in (x, base, *a, *b)]
    x1, base1, a1, b1 = leaves[0], leaves[1], leaves[2:6], leaves[6:]
    y1 = multi_lora_linear(x1, base1, torch.cat(a1), torch.cat(b1, dim=1), layout)
    leaves2 = [t.clone().requires_grad_() for t in (x, base, *a, *b)]
    x2, base2, a2, b2 = leaves2[0], leaves2[1], leaves2[2:6], leaves2[6:]
    y2 = multi_lora_linear_reference(x2, base2, a2, b2, layout)
    _close(y1, y2, torch.float32)
    dy = torch.randn(y1.shape, generator=g).to(DEVICE)
    y1.backward(dy)
    y2.backward(dy)
    for got, want in zip(leaves, leaves2, strict=True):
        if want.grad is None:  # the empty adapter's factors never enter the loop
            assert torch.all(got.grad == 0)
        else:
            _close(got.grad, want.grad, torch.float32)


def test_segments_in_any_order_and_nan_stays_in_its_adapter():
    # Adapter 1's tokens come first; adapter 0's tokens hold a NaN.
    ranks, scales = (8, 4), (2.0, 1.0)
    layout = MultiLoraLayout.from_segments((6, 0), (11, 6), ranks, scales, device=DEVICE)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(11, K, generator=g)
    x[7, 3] = float("nan")
    x = x.to(DEVICE).requires_grad_()
    base = torch.zeros(11, N, device=DEVICE)
    a = [torch.randn(r, K, generator=g).to(DEVICE).requires_grad_() for r in ranks]
    b = [torch.randn(N, r, generator=g).to(DEVICE).requires_grad_() for r in ranks]
    a_cat = torch.cat(a)
    a_cat.retain_grad()
    b_cat = torch.cat(b, dim=1)
    b_cat.retain_grad()
    y = multi_lora_linear(x, base, a_cat, b_cat, layout)
    y.sum().backward()
    assert torch.isnan(y[6:]).any() and torch.isfinite(y[:6]).all()
    assert torch.isfinite(x.grad[:6]).all()
    assert torch.isfinite(a_cat.grad[8:]).all() and torch.isfinite(b_cat.grad[:, 8:]).all()
    clean = multi_lora_linear_reference(x[:6].detach(), base[:6], [a[1]], [b[1]], _one(layout, 1))
    _close(y[:6], clean, torch.float32)


def _one(layout, i):
    return MultiLoraLayout.from_token_counts(
        [layout.tokens_of(i)], [layout.ranks[i]], [layout.scales[i]], device=DEVICE
    )


def test_layout_rejects_bad_segments_and_ranks():
    with pytest.raises(ValueError, match="cover"):
        MultiLoraLayout.from_segments((0, 5), (4, 8), (4, 4), (1.0, 1.0))
    with pytest.raises(ValueError, match="cover"):
        MultiLoraLayout.from_segments((0, 3), (4, 8), (4, 4), (1.0, 1.0))
    with pytest.raises(ValueError, match="rank must be >= 1"):
        MultiLoraLayout.from_token_counts((3, 3), (4, 0), (1.0, 1.0))
    with pytest.raises(ValueError, match="scale must be finite"):
        MultiLoraLayout.from_token_counts((3, 3), (4, 4), (1.0, float("nan")))
    with pytest.raises(ValueError, match="one entry per adapter"):
        MultiLoraLayout.from_token_counts((3, 3), (4,), (1.0, 1.0))


def test_launchers_name_shape_and_dtype_errors():
    layout = _layout()
    x = torch.randn(layout.num_tokens, K, device=DEVICE)
    a, b = _factors(layout, torch.float32)
    a_cat, b_cat = torch.cat(a), torch.cat(b, dim=1)
    with pytest.raises(ValueError, match="sum of ranks"):
        lora_shrink(x, a_cat[1:], layout)
    with pytest.raises(ValueError, match="tokens"):
        lora_shrink(x[1:], a_cat, layout)
    with pytest.raises(TypeError, match="one dtype"):
        lora_shrink(x, a_cat.half(), layout)
    with pytest.raises(TypeError, match="unsupported dtype"):
        lora_shrink(x.double(), a_cat.double(), layout)
    base = torch.zeros(layout.num_tokens, N, device=DEVICE)
    with pytest.raises(ValueError, match="b_cat shape"):
        multi_lora_linear(x, base, a_cat, b_cat[:, 1:], layout)


def test_registered_backends_compute_the_same_op():
    from loka.kernels import registry

    names = registry.names("multi_lora")
    assert names == ["triton.multi_lora", "torch.multi_lora_loop"]  # highest priority first
    layout = _layout()
    a, b = _factors(layout, torch.float32, seed=6)
    x = torch.randn(layout.num_tokens, K, device=DEVICE)
    base = torch.randn(layout.num_tokens, N, device=DEVICE)
    args = (x, base, torch.cat(a), torch.cat(b, dim=1), layout)
    outputs = [registry.get(name)(*args) for name in names]
    _close(outputs[0], outputs[1], torch.float32)
    _close(outputs[0], registry.get(names[0]).reference(*args), torch.float32)
    assert registry.get("torch.multi_lora_loop").runnable_reason("cpu") is None
