"""The REPREC pipeline end to end on a tiny dataset (SASRec, backbone pretraining, REPREC,
LoRA, the cheap setting, zero-shot), its written results, and the `loka reprec` command."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="REPREC needs transformers")
pytest.importorskip("peft", reason="REPREC's LoRA baseline needs peft")

from loka.reprec import BackboneConfig, PretrainConfig, RepRecConfig, TrainConfig, run_reprec
from loka.reprec.pipeline import METHODS

TINY_BACKBONE = BackboneConfig(hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32)


def _write_data(folder: Path) -> Path:
    rng = np.random.default_rng(0)
    lines = []
    for user in range(48):
        # Activity spread over the three groups: cold (<= 5), medium, warm (> 20).
        length = (5, 12, 30)[user % 3]
        lines.append(" ".join(map(str, [user + 1, *rng.integers(1, 61, length)])))
    (folder / "Beauty.txt").write_text("\n".join(lines) + "\n")
    return folder


def _config(folder: Path, **overrides) -> RepRecConfig:
    train = TrainConfig(epochs=2, batch_size=16)
    return RepRecConfig(
        **{
            "data_dir": str(folder),
            "sasrec_preset": "tiny",
            "sasrec_steps": 10,
            "sasrec_batch": 16,
            "sasrec_max_seq_len": 16,
            "backbone": TINY_BACKBONE,
            "pretrain": PretrainConfig(epochs=1, batch_size=8, block=32),
            "reprec": train,
            "lora": train,
            "eval_users": 30,
            "eval_negatives": 20,
            "eval_sampling": ("mixed", "uniform"),
            **overrides,
        }
    )


def test_pipeline_runs_every_method_on_the_same_candidates(tmp_path: Path) -> None:
    report = run_reprec(_config(_write_data(tmp_path), save_backbone_to=str(tmp_path / "llm")))
    rows = report.rows
    assert {r["method"] for r in rows} == set(METHODS)
    for method in METHODS:
        for negatives in ("mixed", "uniform"):
            mine = {
                r["group"]: r for r in rows if r["method"] == method and r["negatives"] == negatives
            }
            assert set(mine) == {"all", "cold", "medium", "warm"}
            assert mine["all"]["users"] == 30
            assert sum(mine[g]["users"] for g in ("cold", "medium", "warm")) == 30
            for row in mine.values():
                assert 0.0 <= row["ndcg@10"] <= row["hr@10"] <= 1.0 and 0.0 < row["mrr"] <= 1.0
                assert row["ndcg@5"] <= row["hr@5"] <= row["hr@10"]
    for method in ("reprec", "lora", "reprec_cheap"):
        log = report.training[method]
        assert len(log["epoch_s"]) == 2 and log["trainable_parameters"] > 0
    # Only the injector trains in REPREC: its parameters, and nothing else, are counted.
    assert report.training["reprec"]["trainable_parameters"] == report.parameters["reprec_injector"]
    assert 0.0 < report.parameters["reprec_share"] < 1.0
    # The injector is sized to LoRA's budget (r=8 on q/v): both counts reported, within 5%.
    lora, injector = report.training["lora"], report.training["reprec"]
    assert lora["trainable_parameters"] == report.parameters["lora_budget"]
    ratio = injector["trainable_parameters"] / lora["trainable_parameters"]
    assert 0.95 < ratio < 1.05 and report.parameters["injector_over_lora"] == pytest.approx(ratio)
    # The cheap variant trains on 10 items and is evaluated on the full 50-item prompts.
    assert report.config["cheap_history"] == 10 and report.config["prompt_history"] == 50
    assert "soft_token_sensitivity" in report.parameters
    assert report.epoch_time_ratio() > 0
    assert (tmp_path / "llm" / "config.json").is_file()
    assert (tmp_path / "llm" / "tokenizer.json").is_file()

    # A run with the saved backbone skips pretraining and gives the same zero-shot scores.
    again = run_reprec(
        _config(tmp_path, backbone_path=str(tmp_path / "llm"), methods=("zero_shot",))
    )
    zero_shot = [r for r in rows if r["method"] == "zero_shot"]
    assert again.rows == zero_shot and "pretrain" not in again.training

    json_path, csv_path = report.write(tmp_path / "out")
    written = json.loads(json_path.read_text())
    assert written["rows"] == json.loads(json.dumps(rows))
    assert written["lora_over_reprec_epoch_time"] == pytest.approx(report.epoch_time_ratio())
    with csv_path.open() as handle:
        assert len(list(csv.DictReader(handle))) == len(rows)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["reprec.csv", "reprec.json"]


def test_bad_configs_and_data_get_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="methods"):
        RepRecConfig(methods=("reprec", "gpt"))
    with pytest.raises(ValueError, match="eval_sampling"):
        RepRecConfig(eval_sampling=("random",))
    with pytest.raises(FileNotFoundError, match=r"Beauty\.txt"):
        run_reprec(_config(tmp_path))


def test_the_subcommand_comes_from_this_package() -> None:
    pytest.importorskip("loka.dispatch", reason="the `loka` command lives in loka-dispatch")
    from loka.dispatch.cli import build_parser

    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    assert commands["reprec"].get_default("loka_package") == "loka-reprec"


def test_cli_runs_the_pipeline_and_writes_the_table(tmp_path: Path, capsys) -> None:
    pytest.importorskip("loka.dispatch", reason="the `loka` command lives in loka-dispatch")
    from loka.dispatch.cli import main

    folder = _write_data(tmp_path)
    out = tmp_path / "results"
    argv = ["reprec", "--data-dir", str(folder), "--device", "cpu", "--out", str(out),
            "--methods", "sasrec,reprec", "--sasrec-preset", "tiny", "--sasrec-steps", "5",
            "--sasrec-batch", "16", "--max-seq-len", "16", "--hidden-size", "16", "--layers", "1", "--heads", "2",
            "--intermediate-size", "32", "--pretrain-epochs", "1", "--epochs", "1",
            "--batch-size", "16", "--mlp-dim", "8", "--eval-users", "12",
            "--eval-negatives", "10", "--negatives", "uniform"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "HR@5/NDCG@5/HR@10/NDCG@10" in printed and "reprec" in printed
    # Not a terminal: progress comes as lines while it runs, not at the end.
    assert "] sasrec: 5/5" in printed and "] train reprec: " in printed
    rows = json.loads((out / "reprec.json").read_text())["rows"]
    assert {(r["method"], r["negatives"]) for r in rows} == {
        ("sasrec", "uniform"),
        ("reprec", "uniform"),
    }
    # Bad input: a clear message and exit status 1, nothing written.
    missing = [
        "reprec",
        "--data-dir",
        str(tmp_path / "x"),
        "--device",
        "cpu",
        "--out",
        str(tmp_path / "none"),
    ]
    assert main(missing) == 1
    assert "not found" in capsys.readouterr().out
    assert not (tmp_path / "none").exists()
    with pytest.raises(SystemExit):
        main(["reprec", "--methods", "reprec,gpt"])
    torch.set_num_threads(1)


def test_any_5_core_file_by_path_or_by_name(tmp_path: Path) -> None:
    from loka.reprec.data import load_dataset, resolve_dataset

    folder = _write_data(tmp_path)
    (folder / "Beauty.txt").rename(folder / "Toys_and_Games.txt")
    path = folder / "Toys_and_Games.txt"
    assert resolve_dataset(str(path)) == path
    assert resolve_dataset("toys", folder) == path
    assert resolve_dataset("Toys_and_Games", folder) == path
    data = load_dataset("toys", folder)
    assert data.name == "Toys_and_Games" and data.num_users == 48
    with pytest.raises(FileNotFoundError, match="Toys_and_Games"):
        resolve_dataset("garden", folder)
    (folder / "Toys_extra.txt").write_text("1 1 2 3\n")
    with pytest.raises(ValueError, match="name one file"):
        resolve_dataset("toys", folder)


def test_item_tokens_seeded_from_sasrec_keep_its_geometry() -> None:
    """`seed_item_embeddings`: item i's token row is SASRec's item i through an orthonormal
    map (Gram matrix kept up to one scale, at the table's RMS); other tokens untouched."""
    from loka.reprec.backbone import build_backbone, seed_item_embeddings
    from loka.reprec.prompts import PromptEncoder
    from loka.reprec.tokenizer import build_item_tokenizer

    tokenizer = build_item_tokenizer(12)
    llm = build_backbone(TINY_BACKBONE, tokenizer)
    prompts = PromptEncoder(tokenizer, 12, history_items=5)
    table = llm.get_input_embeddings().weight
    before = table.detach().clone()
    items = torch.randn(13, 8)
    assert seed_item_embeddings(llm, prompts, items) == 12
    rows = prompts.item_ids[1:, 0]
    seeded = table.detach()[rows].double()
    gram, expected = seeded @ seeded.T, items[1:].double() @ items[1:].double().T
    scale = gram.trace() / expected.trace()
    assert torch.allclose(gram, scale * expected, atol=1e-4 * gram.abs().max().item())
    assert seeded.pow(2).mean().sqrt().item() == pytest.approx(
        before.double().pow(2).mean().sqrt().item(), rel=0.05
    )
    others = torch.ones(table.size(0), dtype=torch.bool)
    others[rows] = False
    assert torch.equal(table.detach()[others], before[others])
    with pytest.raises(ValueError, match="num_items"):
        seed_item_embeddings(llm, prompts, torch.randn(5, 8))
    with pytest.raises(ValueError, match="NaN"):
        seed_item_embeddings(llm, prompts, torch.full((13, 8), float("nan")))


def test_pipeline_seeds_item_tokens_from_sasrec(tmp_path: Path) -> None:
    report = run_reprec(_config(_write_data(tmp_path), item_init="sasrec", methods=("zero_shot",)))
    assert any("seeded from SASRec" in note for note in report.notes)
    with pytest.raises(ValueError, match="item_init"):
        RepRecConfig(item_init="glove")
    with pytest.raises(ValueError, match="backbone_path"):
        RepRecConfig(item_init="sasrec", backbone_path="somewhere")
