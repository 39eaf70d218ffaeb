import pytest
from hypothesis import given
from hypothesis import strategies as st

from loka.schema import BF16, FP8_FORMATS, GRANULARITIES, Recipe, RecipeError


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
    ],
)
def test_bad_recipes_name_the_problem(text, match):
    with pytest.raises(RecipeError, match=match):
        Recipe.parse(text)


def test_non_string_and_bf16_with_options_are_refused():
    with pytest.raises(RecipeError, match="is a string"):
        Recipe.parse(3)
    with pytest.raises(RecipeError, match="takes no FP8 options"):
        Recipe(pow2=True)
