"""LoRDBA storage: footprint, bit-exact save/load, corrupted files, atomic writes."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import json

import pytest
import safetensors.torch
import torch
from torch import nn

from loka.lordba import (
    LoRDBAConfig,
    LoRDBALinear,
    load_lordba,
    lordba_footprint,
    read_lordba,
    save_lordba,
)


def test_footprint_at_hidden_4096_rank_16():
    default = lordba_footprint(4096, 4096, 16)
    # signs: 2 x 16 x 4096 / 8 bytes; scales: (16 + 4096) fp16 (m and p; no q by default).
    assert default.lordba_bytes == 2 * 16 * 512 + 2 * (16 + 4096)
    assert default.lora_fp16_bytes == 2 * 16 * (4096 + 4096)
    assert default.ratio == pytest.approx(10.65, abs=0.01)  # the aim: >= 10x
    with_q = lordba_footprint(4096, 4096, 16, input_scale=True)
    assert with_q.lordba_bytes == default.lordba_bytes + 2 * 4096
    assert with_q.ratio == pytest.approx(7.99, abs=0.01)  # q costs as much as a sign factor
    assert lordba_footprint(4096, 4096, 32, input_scale=True).ratio >= 10
    # p costs 2 bytes per output channel: a wide up-projection stays under 10x at rank 16.
    assert lordba_footprint(4096, 11008, 16).ratio == pytest.approx(9.25, abs=0.01)
    assert lordba_footprint(4096, 11008, 32, input_scale=True).ratio >= 10
    assert lordba_footprint(13, 5, 3).lordba_bytes == 3 * 2 + 3 * 1 + 2 * (3 + 5)
    assert lordba_footprint(13, 5, 3, input_scale=True).lordba_bytes == 3 * 2 + 3 * 1 + 2 * (
        13 + 3 + 5
    )


def _model(seed=0, input_scale=True):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(20, 12), nn.ReLU(), nn.Linear(12, 7))
    config = LoRDBAConfig(rank=3, input_scale=input_scale, backend="torch")
    model[0] = LoRDBALinear(model[0], config)
    model[2] = LoRDBALinear(model[2], config)
    for module in (model[0], model[2]):
        with torch.no_grad():
            module.scale_out.normal_()
            module.latent_b.normal_()
    return model


def _fresh_base(seed=0):
    """The same base weights as ``_model(seed)``, without adapters."""
    model = _model(seed)
    return nn.Sequential(model[0].base, nn.ReLU(), model[2].base)


@pytest.mark.parametrize("input_scale", [True, False])
def test_save_load_round_trip_is_bit_exact(tmp_path, input_scale):
    model = _model(input_scale=input_scale)
    path = tmp_path / "adapter.safetensors"
    written = save_lordba(model, path)
    assert written == path.stat().st_size
    loaded = load_lordba(_fresh_base(), path, LoRDBAConfig(backend="torch"))
    assert isinstance(loaded[0], LoRDBALinear) and isinstance(loaded[2], LoRDBALinear)
    save_lordba(loaded, tmp_path / "again.safetensors")
    first, second = read_lordba(path), read_lordba(tmp_path / "again.safetensors")
    assert first.keys() == second.keys() == {"0", "2"}
    for name in first:
        assert first[name].record() == second[name].record()
        for field in ("signs_a", "signs_b", "scale_in", "scale_rank", "scale_out"):
            saved, reloaded = getattr(first[name], field), getattr(second[name], field)
            assert (saved is None and reloaded is None) or torch.equal(saved, reloaded)
    # The loaded adapter computes exactly what the saved one did with fp16-rounded scales.
    with torch.no_grad():
        for module in (model[0], model[2]):
            for param in (module.scale_in, module.scale_rank, module.scale_out):
                if param is not None:
                    param.copy_(param.half().float())
        x = torch.randn(6, 20)
        assert torch.equal(loaded(x), model(x))


@pytest.mark.parametrize("input_scale", [True, False])
def test_stored_bytes_match_the_footprint(tmp_path, input_scale):
    save_lordba(_model(input_scale=input_scale), tmp_path / "a.safetensors")
    packed = read_lordba(tmp_path / "a.safetensors")
    for name, k, n in (("0", 20, 12), ("2", 12, 7)):
        footprint = lordba_footprint(k, n, 3, input_scale=input_scale)
        assert packed[name].nbytes == footprint.lordba_bytes


def _rewrite(path, mutate_tensors=None, mutate_metadata=None):
    tensors = safetensors.torch.load_file(str(path))
    with safetensors.safe_open(str(path), framework="pt") as file:
        metadata = dict(file.metadata())
    if mutate_tensors:
        mutate_tensors(tensors)
    if mutate_metadata:
        mutate_metadata(metadata)
    safetensors.torch.save_file(tensors, str(path), metadata=metadata)


def _drop_last_byte(t):
    t["0.signs_a"] = t["0.signs_a"][:, :-1].contiguous()


def _set_padding_bit(t):
    t["2.signs_b"][0, -1] |= 0b1000_0000  # 7 signs per row: bit 7 is padding


def _nan_scale(t):
    t["0.scale_out"][3] = float("nan")


def _bump_version(m):
    m["format_version"] = "99"


def _bad_rank(m):
    records = json.loads(m["modules"])
    records["0"]["rank"] = 4
    m["modules"] = json.dumps(records)


def _int16_signs(t):
    t["0.signs_a"] = t["0.signs_a"].to(torch.int16)


def _fp32_scale(t):
    t["0.scale_rank"] = t["0.scale_rank"].float()


def _drop_scale(t):
    t.pop("2.scale_out")


def _extra_tensor(t):
    t["2.extra"] = torch.zeros(1)


CORRUPTIONS = [
    ("wrong byte count", _drop_last_byte, None, ValueError, r"0.signs_a: expected shape \(3, 3\)"),
    ("wrong sign dtype", _int16_signs, None, TypeError, "uint8"),
    ("stray padding bit", _set_padding_bit, None, ValueError, "padding bits"),
    ("scale dtype", _fp32_scale, None, TypeError, "float16"),
    ("NaN scale", _nan_scale, None, ValueError, "0.scale_out: contains NaN"),
    ("missing tensor", _drop_scale, None, ValueError, "missing tensors"),
    ("extra tensor", _extra_tensor, None, ValueError, "unexpected tensors"),
    ("version", None, _bump_version, ValueError, "format_version '99' is not supported"),
    ("rank", None, _bad_rank, ValueError, "declares rank 4"),
]


@pytest.mark.parametrize(
    ("label", "mutate_tensors", "mutate_metadata", "error", "match"),
    CORRUPTIONS,
    ids=[c[0] for c in CORRUPTIONS],
)
def test_corrupted_files_are_refused_and_leave_the_model_alone(
    tmp_path, label, mutate_tensors, mutate_metadata, error, match
):
    path = tmp_path / "adapter.safetensors"
    save_lordba(_model(), path)
    _rewrite(path, mutate_tensors, mutate_metadata)
    base = _fresh_base()
    before = {k: v.clone() for k, v in base.state_dict().items()}
    with pytest.raises(error, match=match):
        load_lordba(base, path)
    assert isinstance(base[0], nn.Linear) and isinstance(base[2], nn.Linear)
    assert all(torch.equal(before[k], v) for k, v in base.state_dict().items())


def test_not_a_lordba_file(tmp_path):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"definitely not safetensors")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        read_lordba(junk)
    other = tmp_path / "other.safetensors"
    safetensors.torch.save_file({"w": torch.zeros(2)}, str(other))
    with pytest.raises(ValueError, match="format is None"):
        read_lordba(other)


def test_shape_mismatch_with_the_model_is_refused_before_any_change(tmp_path):
    path = tmp_path / "adapter.safetensors"
    save_lordba(_model(), path)
    wrong = nn.Sequential(nn.Linear(20, 12), nn.ReLU(), nn.Linear(12, 8))  # 8 outputs, not 7
    with pytest.raises(ValueError, match=r"adapter is for \[12 -> 7\]"):
        load_lordba(wrong, path)
    assert isinstance(wrong[0], nn.Linear) and wrong[0].weight.requires_grad
    with pytest.raises(ValueError, match="no such module"):
        load_lordba(nn.Sequential(nn.Linear(20, 12)), path)


def test_failed_save_keeps_the_previous_file(tmp_path):
    path = tmp_path / "adapter.safetensors"
    model = _model()
    save_lordba(model, path)
    previous = path.read_bytes()
    with torch.no_grad():
        model[0].scale_out[0] = 1e6  # beyond fp16
    with pytest.raises(ValueError, match="beyond float16 range"):
        save_lordba(model, path)
    with torch.no_grad():
        model[0].latent_a[0, 0] = float("nan")
    with pytest.raises(ValueError, match="latent_a: contains NaN"):
        save_lordba(model, path)
    assert path.read_bytes() == previous
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter.safetensors"]
    with pytest.raises(ValueError, match="no LoRDBALinear"):
        save_lordba(nn.Linear(2, 2), path)


def test_single_module_round_trip(tmp_path):
    module = _model()[0]
    path = tmp_path / "one.safetensors"
    save_lordba(module, path)
    loaded = load_lordba(nn.Linear(20, 12), path)
    assert isinstance(loaded, LoRDBALinear)
    assert torch.equal(loaded.packed_signs().a, module.packed_signs().a)
