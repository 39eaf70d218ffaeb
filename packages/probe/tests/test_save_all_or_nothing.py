"""`Probe.save` writes all three tables or none; `ProbeConfig.exclude` takes one string."""

from __future__ import annotations

import os

import pytest

import loka.probe.probe as probe_module
import loka.zoo as zoo
from loka.probe import Probe, ProbeConfig
from loka.schema import TableWriteError

QUICK = ProbeConfig(every=2, warmup_steps=0, rows=64, queue_size=64)


@pytest.fixture(scope="module")
def trained_probe():
    setup = zoo.create("dlrm", "tiny")
    probe = Probe(setup.model, QUICK)
    zoo.train(setup, 2, on_step=lambda step, loss: probe.step())
    yield probe, setup
    probe.detach()


def _contents(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def test_a_failing_third_swap_puts_the_first_two_back(trained_probe, tmp_path, monkeypatch):
    probe, setup = trained_probe
    probe.save(tmp_path)
    before = _contents(tmp_path)
    zoo.train(setup, 2, on_step=lambda step, loss: probe.step())
    real = os.replace
    moved_in = []

    def replace(src, dst):
        into_place = os.path.dirname(dst) == str(tmp_path) and "old-" not in str(src)
        if into_place and str(src).endswith(".parquet"):
            moved_in.append(dst)
            if len(moved_in) == 3:
                raise IsADirectoryError(21, "Is a directory", str(dst))
        return real(src, dst)

    monkeypatch.setattr(probe_module.os, "replace", replace)
    with pytest.raises(TableWriteError) as info:
        probe.save(tmp_path)
    monkeypatch.undo()
    message = str(info.value)
    assert "site_errors.parquet" in message and "old tables were left in place" in message
    assert "\n" not in message
    assert _contents(tmp_path) == before  # the two swapped tables were put back
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_failing_swap_into_an_empty_folder_leaves_it_empty(trained_probe, tmp_path, monkeypatch):
    probe, _ = trained_probe
    real = os.replace
    calls = []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(probe_module.os, "replace", replace)
    with pytest.raises(TableWriteError, match="No space left on device"):
        probe.save(tmp_path)
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


def test_a_directory_in_the_way_is_refused_before_anything_moves(trained_probe, tmp_path):
    probe, _ = trained_probe
    probe.save(tmp_path)
    before = _contents(tmp_path)
    (tmp_path / "site_errors.parquet").unlink()
    (tmp_path / "site_errors.parquet").mkdir()
    (tmp_path / "site_errors.parquet" / "keep.txt").write_text("mine")
    with pytest.raises(TableWriteError, match=r"site_errors\.parquet is a directory"):
        probe.save(tmp_path)
    assert (tmp_path / "site_errors.parquet" / "keep.txt").read_text() == "mine"
    assert _contents(tmp_path) == {k: v for k, v in before.items() if k != "site_errors.parquet"}


def test_exclude_as_one_string_is_one_pattern():
    config = ProbeConfig(exclude="top_mlp*")
    assert config.exclude == ("top_mlp*",)
    assert config.excluded("top_mlp.0") and not config.excluded("t")
    assert ProbeConfig(exclude=["a", "b"]).exclude == ("a", "b")
    with pytest.raises(TypeError, match="site patterns"):
        ProbeConfig(exclude=("a", 3))
