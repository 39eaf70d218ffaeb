"""loka.kernels.tuning: the tiles launched without autotuning, set and read through one API."""

import pytest

from loka.kernels import launch, tuning


@pytest.fixture
def restored():
    before = tuning.tiles()
    yield
    gemm_tma = {k == "True": v for k, v in before["gemm_tma"].items()}
    tuning.set_tiles(
        quantize_rows=before["quantize_rows"],
        transpose=before["transpose"],
        gemm=before["gemm"],
        gemm_tma=gemm_tma,
        grouped=before["grouped"],
        row_block_scales_transposed=before["row_block_scales_transposed"],
    )
    assert tuning.tiles() == before


def test_set_tiles_sets_only_the_given_keys(restored):
    before = tuning.tiles()
    tuning.set_tiles(gemm={"plain": (64, 64, 128, 4, 3)}, quantize_rows={"warps": 8})
    after = tuning.tiles()
    assert after["gemm"] == {**before["gemm"], "plain": (64, 64, 128, 4, 3)}
    assert after["quantize_rows"] == {**before["quantize_rows"], "warps": 8}
    assert after["transpose"] == before["transpose"]
    assert set(after) == set(tuning.KNOBS)


def test_unknown_key_is_refused_before_any_change(restored):
    before = tuning.tiles()
    with pytest.raises(ValueError, match=r"unknown keys.*'huge'"):
        tuning.set_tiles(gemm={"huge": (1, 1, 1, 1, 1)})
    assert tuning.tiles() == before


def test_launch_cache_is_restored_after_the_block():
    assert launch.ENABLED
    with pytest.raises(RuntimeError), tuning.launch_cache(False):
        assert not launch.ENABLED
        raise RuntimeError
    assert launch.ENABLED
