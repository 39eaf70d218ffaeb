"""ProbeConfig: validation, per-site budgets, the schedule."""

from __future__ import annotations

import pytest

from loka.probe import DEFAULT_BUDGETS, DEFAULT_RECIPES, ProbeConfig
from loka.schema import RecipeError


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every": 0}, "every must be a positive integer"),
        ({"rows": -5}, "rows must be a positive integer"),
        ({"confidence": 1.0}, r"confidence must be in \[0.5, 1\)"),
        ({"drift_tolerance": 0.5}, "drift_tolerance is a factor > 1"),
        ({"recipes": {"fprop": ("e4m3:e4m3/tensor/dynamic",)}}, "unknown passes"),
        ({"recipes": {"fwd": "e4m3:e4m3/tensor/dynamic"}}, "sequence of recipe strings"),
        ({"recipes": {"fwd": ("bf16",)}}, "bf16 is the reference"),
        ({"budgets": {"fwd": -1.0, "dgrad": 1, "wgrad": 1}}, "positive number"),
        ({"budgets": {"fwd": 0.1}}, r"no budget for pass\(es\) \['dgrad', 'wgrad'\]"),
        ({"site_budgets": {"top.*": {"bwd": 0.1}}}, "unknown pass 'bwd'"),
    ],
)
def test_bad_settings_are_refused_with_the_reason(kwargs, message) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        ProbeConfig(**kwargs)


def test_bad_recipe_strings_name_the_problem() -> None:
    with pytest.raises(RecipeError, match="granularity"):
        ProbeConfig(recipes={"fwd": ("e4m3:e4m3/channel/dynamic",)}, budgets={"fwd": 0.1})


def test_site_budgets_override_by_pattern_last_match_wins() -> None:
    config = ProbeConfig(
        site_budgets={"top.*": {"fwd": 0.2}, "top.head": {"fwd": 0.3, "wgrad": 0.5}}
    )
    assert config.budget("bottom.0", "fwd") == DEFAULT_BUDGETS["fwd"]
    assert config.budget("top.1", "fwd") == 0.2
    assert config.budget("top.head", "fwd") == 0.3
    assert config.budget("top.head", "dgrad") == DEFAULT_BUDGETS["dgrad"]
    assert config.budget("top.head", "wgrad") == 0.5


def test_schedule_is_denser_early() -> None:
    config = ProbeConfig(every=25, warmup_steps=100, warmup_every=10)
    sampled = [s for s in range(300) if config.is_sampled(s)]
    assert sampled[:10] == list(range(0, 100, 10))
    assert sampled[10:] == list(range(100, 300, 25))
    assert ProbeConfig().history_lengths() == {16}


def test_default_recipes_cover_every_pass_and_parse() -> None:
    parsed = ProbeConfig().parsed_recipes()
    assert {p: len(r) for p, r in parsed.items()} == {p: len(DEFAULT_RECIPES[p]) for p in parsed}
    assert {str(r) for r in parsed["dgrad"]} >= {
        "e5m2:e4m3/tensor/dynamic",
        "e4m3:e4m3/tensor/dynamic",
    }


def test_student_t_quantile_without_scipy_matches_scipy(monkeypatch) -> None:
    import sys

    from scipy import stats

    from loka.probe import verdict

    verdict._t_quantile.cache_clear()
    monkeypatch.setitem(sys.modules, "scipy", None)  # as on a GPU image without scipy
    try:
        for dof in (1, 2, 3, 4, 9, 30, 501):
            for c in (0.9, 0.95, 0.999):
                assert verdict._t_quantile(c, dof) == pytest.approx(stats.t.ppf(c, dof), rel=1e-9)
    finally:
        verdict._t_quantile.cache_clear()
