import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loka.schema import BF16, FP8_FORMATS, GRANULARITIES, QuantConfig, Recipe, RecipeError
from loka.schema.formats import BLOCK_SHAPES


def test_parse_examples():
    r = Recipe.parse("e4m3:e4m3/row/dynamic")
    assert (r.a_format, r.b_format, r.granularity, r.scaling) == ("e4m3", "e4m3", "row", "dynamic")
    assert not r.pow2 and r.scale_ub is None and not r.is_bf16
    d = Recipe.parse("e5m2:e4m3/tensor/delayed16/pow2/ub=1024")
    assert (d.scaling, d.history, d.pow2, d.scale_ub) == ("delayed", 16, True, 1024.0)
    assert Recipe.parse("bf16") is BF16 and BF16.is_bf16


@st.composite
def recipes(draw):
    if draw(st.booleans()) and draw(st.booleans()):
        return BF16
    gran = draw(st.sampled_from(GRANULARITIES))
    delayed = gran == "tensor" and draw(st.booleans())
    return Recipe(
        a_format=draw(st.sampled_from(FP8_FORMATS)),
        b_format=draw(st.sampled_from(FP8_FORMATS)),
        granularity=gran,
        scaling="delayed" if delayed else "dynamic",
        history=draw(st.integers(1, 1024)) if delayed else 0,
        pow2=draw(st.booleans()),
        scale_ub=draw(st.none() | st.floats(1e-6, 1e30)),
        center=not delayed and draw(st.booleans()),
    )


@given(recipes())
def test_string_roundtrip(recipe):
    assert Recipe.parse(str(recipe)) == recipe


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("e4m3/row/dynamic", "'A:B'"),
        ("e4m3:fp4/row/dynamic", "b_format must be one of"),
        ("e4m3:e4m3/column/dynamic", "granularity must be one of"),
        ("e4m3:e4m3/row/lazy", "scaling must be"),
        ("e4m3:e4m3/row/delayed16", "tensorwise scales only"),
        ("e4m3:e4m3/tensor/delayed0", "at least 1 step"),
        ("e4m3:e4m3/row/dynamic/pow2/pow2", "repeated option"),
        ("e4m3:e4m3/row/dynamic/ub=abc", "bad scale bound"),
        ("e4m3:e4m3/row/dynamic/ub=-1", "finite and positive"),
        ("e4m3:e4m3/row", "expected"),
        ("e4m3:e4m3/tensor/delayed16/center", "center takes dynamic scaling"),
        ("e4m3:e4m3/row/dynamic/center/center", "repeated option"),
    ],
)
def test_bad_recipes_name_the_problem(text, match):
    with pytest.raises(RecipeError, match=match):
        Recipe.parse(text)


def test_center_is_a_recipe_option_not_an_operands():
    r = Recipe.parse("e4m3:e4m3/row/dynamic/pow2/center")
    assert r.center and r.pow2 and str(r) == "e4m3:e4m3/row/dynamic/pow2/center"
    assert not Recipe.parse("e4m3:e4m3/row/dynamic").center
    assert r.operand("a", False) == QuantConfig.parse("e4m3/row/pow2")
    with pytest.raises(RecipeError, match="unknown or repeated option 'center'"):
        QuantConfig.parse("e4m3/row/center")
    with pytest.raises(RecipeError, match="takes no FP8 options"):
        Recipe(center=True)


def test_non_string_and_bf16_with_options_are_refused():
    with pytest.raises(RecipeError, match="is a string"):
        Recipe.parse(3)
    with pytest.raises(RecipeError, match="takes no FP8 options"):
        Recipe(pow2=True)


def test_fp8_recipes_default_to_dynamic_scaling():
    assert Recipe("e4m3", "e4m3", "row") == Recipe.parse("e4m3:e4m3/row/dynamic")
    assert Recipe.of("e4m3:e4m3/row/dynamic") is Recipe.of(Recipe.parse("e4m3:e4m3/row/dynamic"))
    with pytest.raises(RecipeError, match="got 'none'"):
        Recipe.parse("e4m3:e4m3/row/none")
    with pytest.raises(RecipeError, match="Recipe or its string"):
        Recipe.of(3)
    with pytest.raises(RecipeError, match="two bf16 operands"):
        Recipe("e4m3", "bf16")


def test_operands_of_each_pass():
    r = Recipe.parse("e5m2:e4m3/block/dynamic/pow2/ub=64")
    fwd_a, fwd_w = r.operands("fwd")
    assert fwd_a == QuantConfig("e5m2", "block", (1, 128), True, 64.0)
    assert fwd_w == QuantConfig("e4m3", "block", (128, 128), True, 64.0)
    assert r.operands("dgrad")[1].block == (128, 128)
    assert r.operands("wgrad")[1].block == (1, 128)  # x^T is an activation
    assert Recipe.parse("e4m3:e4m3/row/dynamic").operands("fwd")[1].block is None
    with pytest.raises(RecipeError, match="quantizes no operand"):
        BF16.operands("fwd")


@st.composite
def operand_configs(draw):
    gran = draw(st.sampled_from(GRANULARITIES))
    return QuantConfig(
        draw(st.sampled_from(FP8_FORMATS)),
        gran,
        draw(st.sampled_from(BLOCK_SHAPES)) if gran == "block" else None,
        draw(st.booleans()),
        draw(st.none() | st.floats(2.0**-126, 1e30)),
    )


@given(operand_configs())
def test_operand_config_string_roundtrip(config):
    assert QuantConfig.parse(str(config)) == config


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: QuantConfig("fp4"), "fmt must be one of"),
        (lambda: QuantConfig("e4m3", "row", (1, 128)), "only applies to granularity 'block'"),
        (lambda: QuantConfig("e4m3", "block", (64, 64)), "block must be one of"),
        (lambda: QuantConfig("e4m3", pow2=1), "pow2 must be a bool"),
        (lambda: QuantConfig("e4m3", scale_ub=1e-40), "at least 2\\*\\*-126"),
        (lambda: QuantConfig.parse("e4m3"), "expected 'fmt/granularity"),
        (lambda: QuantConfig.parse("e4m3/block/3x3"), "block must be one of"),
    ],
)
def test_bad_operand_configs_name_the_problem(make, match):
    with pytest.raises(RecipeError, match=match):
        make()


def test_the_vocabulary_loads_neither_polars_nor_torch():
    code = (
        "import sys; from loka.schema import FP8_MAX, QuantConfig, Recipe; "
        "Recipe.parse('e4m3:e4m3/row/dynamic').operands('fwd'); "
        "assert 'polars' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
