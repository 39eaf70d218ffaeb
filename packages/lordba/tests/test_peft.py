"""Conversion of a peft LoRA checkpoint to LoRDBA."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import copy
import math

import pytest
import torch
from torch import nn

peft = pytest.importorskip("peft", reason="the tests write their LoRA checkpoints with peft")

from loka.lordba import LoRDBAConfig, convert_peft_checkpoint, load_lordba, read_lordba  # noqa: E402


class TinyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(24, 24)
        self.up = nn.Linear(24, 40)
        self.down = nn.Linear(40, 24)

    def forward(self, x):
        return self.down(torch.relu(self.up(self.q_proj(x))))


def _peft_model(lora_config, rank_one_magnitudes, seed=0, column_profile=True):
    torch.manual_seed(seed)
    base = TinyBlock()
    reference_base = copy.deepcopy(base)
    model = peft.get_peft_model(base, lora_config)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" not in name:
                continue
            if rank_one_magnitudes:  # |A|, |B| of rank one: LoRDBA represents them exactly
                rows, cols = param.shape
                signs = torch.randint(0, 2, (rows, cols), generator=gen) * 2.0 - 1.0
                columns = torch.rand(cols, generator=gen) + 0.5
                if "lora_A" in name and not column_profile:  # without q: constant rows of |A|
                    columns = torch.ones(cols)
                magnitude = torch.outer(torch.rand(rows, generator=gen) + 0.5, columns)
                param.copy_(0.1 * signs * magnitude)
            else:
                param.normal_(0.0, 0.1, generator=gen)
    return model.eval(), reference_base


@pytest.mark.parametrize("input_scale", [False, True])
def test_rank_one_lora_checkpoint_converts_exactly(tmp_path, input_scale):
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "up", "down"],
        use_rslora=True,
        alpha_pattern={"up": 16},
    )
    model, base = _peft_model(config, rank_one_magnitudes=True, column_profile=input_scale)
    model.save_pretrained(tmp_path / "ckpt")
    result = convert_peft_checkpoint(
        tmp_path / "ckpt", tmp_path / "lordba.safetensors", input_scale=input_scale
    )
    assert set(result.fits) == {"q_proj", "up", "down"}
    stored = read_lordba(tmp_path / "lordba.safetensors")
    assert all((p.scale_in is not None) == input_scale for p in stored.values())
    assert all(fit.reconstruction_error < 1e-5 for fit in result.fits.values())
    assert result.footprint.lora_fp16_bytes == 2 * 4 * ((24 + 24) + (24 + 40) + (40 + 24))
    converted = load_lordba(base, tmp_path / "lordba.safetensors", LoRDBAConfig(backend="torch"))
    x = torch.randn(5, 24)
    with torch.no_grad():
        torch.testing.assert_close(converted(x), model(x), rtol=2e-3, atol=2e-4)  # fp16 scales


def test_generic_lora_checkpoint_error_matches_the_fit_report(tmp_path):
    config = peft.LoraConfig(r=4, lora_alpha=4, target_modules=["up"])
    model, base = _peft_model(config, rank_one_magnitudes=False)
    model.save_pretrained(tmp_path / "ckpt")
    result = convert_peft_checkpoint(tmp_path / "ckpt", tmp_path / "lordba.safetensors")
    fit = result.fits["up"]
    assert 0.05 < fit.reconstruction_error <= fit.error_bound
    assert read_lordba(tmp_path / "lordba.safetensors")["up"].scale_in is None
    converted = load_lordba(base, tmp_path / "lordba.safetensors", LoRDBAConfig(backend="torch"))
    lora_delta = model.base_model.model.up.get_delta_weight("default").detach()
    lordba_delta = converted.up.delta_weight()
    measured = float((lordba_delta - lora_delta).norm() / lora_delta.norm())
    assert measured == pytest.approx(fit.reconstruction_error, rel=1e-2)  # fp16 scales aside


def test_unsupported_checkpoints_are_refused(tmp_path):
    config = peft.LoraConfig(r=2, target_modules=["up"], use_dora=True)
    model, _ = _peft_model(config, rank_one_magnitudes=False)
    model.save_pretrained(tmp_path / "dora")
    with pytest.raises(ValueError, match="DoRA cannot be converted"):
        convert_peft_checkpoint(tmp_path / "dora", tmp_path / "out.safetensors")
    with pytest.raises(FileNotFoundError, match=r"no adapter_config\.json"):
        convert_peft_checkpoint(tmp_path / "missing", tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()


def test_scaling_follows_peft_rules():
    from loka.lordba.peft import _pattern_value

    assert _pattern_value({"up": 16}, "layers.0.up", 8) == 16
    assert _pattern_value({"up": 16}, "layers.0.setup", 8) == 8  # dot boundary only
    assert math.isclose(16 / math.sqrt(4), 8.0)
