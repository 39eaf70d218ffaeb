"""Which 5-core file a run reads, and the SASRec user encoder's setup on it.

Any file of `user item item ...` lines (items in chronological order, ids from 1) works:
`dataset` is a path to such a file, or a name looked up in the data folder ("beauty" and
"sports" as loka-zoo names them, else a file whose name, without `.txt`, matches
case-insensitively, or starts with the name followed by "_": "toys" finds
`Toys_and_Games.txt`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

import loka.zoo as zoo
from loka.zoo.data import amazon
from loka.zoo.data.amazon import AmazonSequences, parse_sequences
from loka.zoo.tasks import next_item_loss, next_item_metrics


def resolve_dataset(dataset: str, data_dir: str | Path | None = None) -> Path:
    """The file `dataset` names: itself when it is a file, else a file of the data folder."""
    given = Path(dataset)
    if given.is_file():
        return given
    if given.suffix or len(given.parts) > 1:
        raise FileNotFoundError(f"data file {dataset} not found")
    folder = Path(data_dir) if data_dir is not None else amazon.default_data_dir()
    name = dataset.lower()
    if name in amazon.FILES and (folder / amazon.FILES[name]).is_file():
        return folder / amazon.FILES[name]
    files = sorted(folder.glob("*.txt")) if folder.is_dir() else []
    exact = [f for f in files if f.stem.lower() == name]
    prefixed = [f for f in files if f.stem.lower().startswith(name + "_")]
    found = exact or prefixed
    if len(found) == 1:
        return found[0]
    if len(found) > 1:
        raise ValueError(
            f"dataset {dataset!r} matches {[f.name for f in found]} in {folder}: name one file"
        )
    known = ", ".join(f.stem for f in files) or "none"
    expected = amazon.FILES.get(name, f"{dataset}.txt")
    raise FileNotFoundError(
        f"dataset {dataset!r} not found: not a file, and no {expected} in {folder} "
        f"(files there: {known}); pass --data FILE or --data-dir FOLDER"
    )


def load_dataset(dataset: str, data_dir: str | Path | None = None) -> AmazonSequences:
    path = resolve_dataset(dataset, data_dir)
    return parse_sequences(path, name=path.stem)


def sasrec_setup(
    data: AmazonSequences,
    preset: str,
    *,
    device: torch.device,
    seed: int,
    batch_size: int,
    max_seq_len: int,
) -> zoo.ZooSetup:
    """loka-zoo's SASRec preset on any loaded 5-core data (its item count from the data)."""
    config, data_config, batch_size = zoo.preset_config(
        "sasrec", preset, batch_size=min(batch_size, data.num_users), max_seq_len=max_seq_len
    )
    config = dataclasses.replace(config, num_items=data.num_items)
    stream = amazon.AmazonStream(
        data,
        batch_size=batch_size,
        max_seq_len=max_seq_len,
        layout=data_config.layout,  # type: ignore[arg-type]
        num_negatives=data_config.num_negatives,
        device=device,
        seed=seed,
        eval_seed=data_config.teacher_seed,
    )
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with device:
            model = zoo.SASRec(config)
    return zoo.ZooSetup(
        "sasrec", preset, model, config, data_config, stream, device, seed, batch_size,
        next_item_loss, next_item_metrics,
    )  # fmt: skip
