"""`python -m loka.stats`: the bundled example and user files."""

import subprocess
import sys

import numpy as np
import pytest

from loka.stats.__main__ import main


def test_bundled_example(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "bundled example" in out and "[256x512], 131072 values" in out
    for needle in [
        "row amax",
        "block amax",
        "e4m3    tensor",
        "e5m2    block 1x128",
        "optimal pow2",
    ]:
        assert needle in out


def test_user_files(tmp_path, capsys, bf16):
    rng = np.random.default_rng(0)
    cases = {
        "three_d.npy": (rng.standard_normal((4, 8, 300)), []),
        "flat.npy": (rng.standard_normal(1000).astype(np.float16), []),
        "bits.npy": (
            bf16.to_bits(rng.standard_normal(2048).astype(np.float32)).reshape(16, 128),
            ["--bf16"],
        ),
    }
    for name, (array, flags) in cases.items():
        np.save(tmp_path / name, array)
        assert main([str(tmp_path / name), "--block", "64", *flags]) == 0
        out = capsys.readouterr().out
        assert f"{array.size} values" in out
        assert ("block 1x64" in out) == (array.ndim >= 2)


def test_bad_files(tmp_path):
    np.save(tmp_path / "ints.npy", np.arange(10))
    with pytest.raises(SystemExit, match="cannot summarize dtype int64"):
        main([str(tmp_path / "ints.npy")])
    with pytest.raises(SystemExit, match="--bf16 expects"):
        main([str(tmp_path / "ints.npy"), "--bf16"])
    (tmp_path / "junk.npy").write_bytes(b"not numpy")
    with pytest.raises(SystemExit):
        main([str(tmp_path / "junk.npy")])


def test_runs_as_a_module():
    done = subprocess.run(
        [sys.executable, "-m", "loka.stats", "--help"], capture_output=True, text=True, check=True
    )
    assert "bundled example" in done.stdout
