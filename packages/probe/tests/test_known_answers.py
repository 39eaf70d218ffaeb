"""Sites whose FP8 verdicts are known in advance, measured end to end through Probe."""

from __future__ import annotations

import torch

K = N = 256
M = 512


def normal(rows: int, cols: int, scale: float = 1.0):
    return lambda step, g: torch.randn(rows, cols, generator=g) * scale


def test_outlier_channels_unsafe_tensorwise_safe_rowwise(synthetic, every_step) -> None:
    Sites, drive, verdict = synthetic
    model = Sites({"w_outliers": (K, N), "x_outliers": (K, N)})
    with torch.no_grad():
        # A few output channels 2^15 larger than the rest: a tensorwise scale pushes every
        # other channel of the weight into e4m3's subnormals.
        model.lins["w_outliers"].weight[:3] *= 2.0**15
    channel_scale = torch.ones(K)
    channel_scale[[5, 77, 200]] = 2.0**15  # input channels (activation outliers)

    tables = drive(
        model,
        inputs={
            "w_outliers": normal(M, K),
            "x_outliers": lambda s, g: torch.randn(M, K, generator=g) * channel_scale,
        },
        grads={"w_outliers": normal(M, N), "x_outliers": normal(M, N)},
        steps=8,
        config=every_step,
    )
    errors = tables["site_errors"]
    site = "lins.w_outliers"
    assert verdict(errors, site, "e4m3:e4m3/tensor/dynamic", "fwd") == "unsafe"
    assert verdict(errors, site, "e4m3:e4m3/row/dynamic", "fwd") == "safe"
    # wgrad reduces over tokens: rowwise scales are per input channel there.
    site = "lins.x_outliers"
    assert verdict(errors, site, "e4m3:e4m3/tensor/dynamic", "wgrad") == "unsafe"
    assert verdict(errors, site, "e4m3:e4m3/row/dynamic", "wgrad") == "safe"
    # A plain Frobenius norm would not see it: the outliers dominate it.
    bad = errors.filter(
        (errors["site"] == site)
        & (errors["recipe"] == "e4m3:e4m3/tensor/dynamic")
        & (errors["pass"] == "wgrad")
    )
    assert bad["frob_rel_err"][0] < 0.05 < bad["mean_rel_err"][0]


def test_wide_dynamic_range_gradients_need_e5m2_in_dgrad(synthetic, every_step) -> None:
    Sites, drive, verdict = synthetic
    model = Sites({"lin": (K, N)})

    def gradient(step, g):
        # Per-sample gradient magnitudes spread over 2^-24..1, as when most samples are
        # already well predicted: e4m3's range (~18 binades) flushes the small ones.
        spread = torch.exp2(-24 * torch.rand(M, 1, generator=g))
        return torch.randn(M, N, generator=g) * spread

    tables = drive(model, {"lin": normal(M, K)}, {"lin": gradient}, steps=8, config=every_step)
    errors = tables["site_errors"]
    assert verdict(errors, "lins.lin", "e4m3:e4m3/tensor/dynamic", "dgrad") == "unsafe"
    assert verdict(errors, "lins.lin", "e5m2:e4m3/tensor/dynamic", "dgrad") == "safe"
    # The weight gradient sums over samples, so the small ones barely matter there.
    assert verdict(errors, "lins.lin", "e4m3:e4m3/tensor/dynamic", "wgrad") == "safe"


def test_growing_amax_flags_delayed_scaling(synthetic, every_step) -> None:
    Sites, drive, verdict = synthetic
    model = Sites({"lin": (K, N)})
    growing = lambda step, g: torch.randn(M, K, generator=g) * 4.0**step  # noqa: E731
    tables = drive(model, {"lin": growing}, {"lin": normal(M, N)}, steps=9, config=every_step)
    errors = tables["site_errors"]
    # Delayed scaling takes its scale from earlier, smaller amaxes and saturates.
    assert verdict(errors, "lins.lin", "e4m3:e4m3/tensor/delayed16", "fwd") == "unsafe"
    assert verdict(errors, "lins.lin", "e4m3:e4m3/tensor/dynamic", "fwd") == "safe"
    delayed = errors.filter(errors["recipe"] == "e4m3:e4m3/tensor/delayed16")
    assert delayed["n"][0] == 8  # step 0 has no amax history: not measured
