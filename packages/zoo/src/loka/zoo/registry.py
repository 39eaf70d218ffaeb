"""`create(name, preset)`: a model, its data and its task, ready to train and evaluate."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loka.zoo import models
from loka.zoo.data import amazon
from loka.zoo.data.behaviour import SyntheticBehaviour, SyntheticBehaviourConfig
from loka.zoo.data.criteo import SyntheticCriteo, SyntheticCriteoConfig
from loka.zoo.data.sequences import SyntheticSequences, SyntheticSequencesConfig, check_layout
from loka.zoo.tasks import click_loss, click_metrics, next_item_loss, next_item_metrics

Batch = dict[str, torch.Tensor]
PRESETS = ("tiny", "base", "large", "xl")


@dataclass(frozen=True)
class SequenceDataConfig:
    """Where a sequential model's data comes from and how batches are laid out."""

    dataset: str = "synthetic"  # "synthetic", or an Amazon 5-core set: "beauty", "sports"
    data_dir: str | None = None
    layout: str = "padded"
    num_negatives: int = 64
    negative_sampling: str = "uniform"
    num_eval_negatives: int = 100
    num_clusters: int = 32
    teacher_seed: int = 0  # names the synthetic dataset, and seeds evaluation negatives

    def __post_init__(self) -> None:
        datasets = ("synthetic", *amazon.FILES)
        if self.dataset not in datasets:
            raise ValueError(f"dataset must be one of {list(datasets)}, got {self.dataset!r}")
        check_layout(self.layout)
        if self.negative_sampling not in ("uniform", "popularity"):
            raise ValueError(
                f"negative_sampling must be 'uniform' or 'popularity', got {self.negative_sampling!r}"
            )
        if self.dataset == "synthetic" and self.negative_sampling != "uniform":
            raise ValueError("synthetic sequences sample negatives uniformly only")


@dataclass(frozen=True)
class _Spec:
    model: Callable[[Any], nn.Module]
    config: type
    data_config: type
    presets: dict[str, tuple[dict[str, Any], dict[str, Any], int]]  # model, data, batch


_CTR_LARGE_ROWS = 200_000  # caps Criteo's largest tables: ~1.5-1.9M rows x 128 fit easily
# xl: production-sized dense arches (linears take most of a compiled step; loka.zoo.estimate)
# with tables of millions of rows, updated row-wise (sparse gradients, row-wise Adagrad).
_CTR_XL_ROWS = 4_000_000

SPECS: dict[str, _Spec] = {
    "dlrm": _Spec(
        models.DLRM,
        models.DLRMConfig,
        SyntheticCriteoConfig,
        {
            "tiny": (dict(embedding_dim=16, max_table_rows=1000), {}, 256),
            "base": (
                dict(embedding_dim=64, max_table_rows=20_000, bottom_widths=(256, 128),
                     top_widths=(512, 256)),
                {},
                4096,
            ),
            "large": (
                dict(embedding_dim=128, max_table_rows=_CTR_LARGE_ROWS, bottom_widths=(512, 256),
                     top_widths=(1024, 1024, 512, 256)),
                {},
                65536,
            ),
        },
    ),
    "dhen": _Spec(
        models.DHEN,
        models.DHENConfig,
        SyntheticCriteoConfig,
        {
            "tiny": (dict(embedding_dim=16, max_table_rows=1000), {}, 256),
            "base": (
                dict(embedding_dim=64, max_table_rows=20_000, width=256, hidden=1024,
                     num_layers=3, bottom_widths=(128,), head_widths=(128,)),
                {},
                4096,
            ),
            "large": (
                dict(num_sparse=32, embedding_dim=128, max_table_rows=_CTR_LARGE_ROWS,
                     width=1024, hidden=4096, num_layers=4, bottom_widths=(512, 256),
                     head_widths=(512,)),
                {},
                16384,
            ),
            "xl": (
                dict(num_sparse=32, embedding_dim=128, max_table_rows=_CTR_XL_ROWS, width=2048,
                     hidden=4096, num_layers=8, bottom_widths=(512, 256),
                     head_widths=(1024, 512), sparse_embeddings=True),
                {},
                16384,
            ),
        },
    ),
    "wukong": _Spec(
        models.Wukong,
        models.WukongConfig,
        SyntheticCriteoConfig,
        {
            "tiny": (dict(embedding_dim=16, max_table_rows=1000), {}, 256),
            "base": (
                dict(embedding_dim=64, max_table_rows=20_000, num_layers=3, fm_outputs=16,
                     lcb_outputs=16, fm_rank=16, fm_hidden=512, bottom_widths=(128,),
                     head_widths=(512,)),
                {},
                4096,
            ),
            "large": (
                dict(embedding_dim=128, max_table_rows=_CTR_LARGE_ROWS, num_layers=4,
                     fm_outputs=16, lcb_outputs=16, fm_rank=32, fm_hidden=2048,
                     bottom_widths=(512, 256), head_widths=(1024, 512)),
                {},
                16384,
            ),
            "xl": (
                dict(embedding_dim=128, max_table_rows=_CTR_XL_ROWS, num_layers=8, fm_outputs=32,
                     lcb_outputs=32, fm_rank=32, fm_hidden=4096, bottom_widths=(512, 256),
                     head_widths=(4096, 1024), sparse_embeddings=True, mixing="bmm"),
                {},
                16384,
            ),
        },
    ),
    "interformer": _Spec(
        models.InterFormer,
        models.InterFormerConfig,
        SyntheticBehaviourConfig,
        {
            "tiny": (dict(embedding_dim=16, max_table_rows=1000, num_items=500, max_seq_len=16,
                          interaction_hidden=64, sequence_hidden=32),
                     dict(num_clusters=16), 256),
            "base": (dict(embedding_dim=64, max_table_rows=20_000, num_items=20_000, max_seq_len=32,
                          num_heads=4, num_layers=3, interaction_hidden=1024, sequence_hidden=256,
                          num_summary=4, num_pma=2, num_recent=4, bottom_widths=(128,),
                          head_widths=(256,)),
                     dict(num_clusters=64, min_seq_len=8), 4096),
            "large": (dict(embedding_dim=128, max_table_rows=_CTR_LARGE_ROWS, num_items=200_000,
                           max_seq_len=64, num_heads=4, num_layers=4, interaction_hidden=2048,
                           sequence_hidden=512, num_summary=4, num_cls=2, num_pma=2,
                           num_recent=4, bottom_widths=(512, 256), head_widths=(1024, 512)),
                      dict(num_clusters=256, min_seq_len=16), 16384),
            "xl": (dict(embedding_dim=256, max_table_rows=_CTR_XL_ROWS, num_items=1_000_000,
                        max_seq_len=16, num_heads=2, num_layers=4, interaction_hidden=4096,
                        sequence_hidden=1024, num_summary=4, num_cls=2, num_pma=2, num_recent=4,
                        bottom_widths=(512, 256), head_widths=(1024, 512),
                        sparse_embeddings=True),
                   dict(num_clusters=1024), 16384),
        },
    ),
    "hstu": _Spec(
        models.HSTU,
        models.HSTUConfig,
        SequenceDataConfig,
        {
            "tiny": (dict(num_items=500, max_seq_len=16, embedding_dim=32, num_heads=2),
                     dict(layout="jagged", num_clusters=20), 32),
            "base": (dict(num_items=20_000, max_seq_len=64, embedding_dim=256, num_heads=4,
                          num_layers=3),
                     dict(layout="jagged", num_negatives=256, num_clusters=128), 256),
            "large": (dict(num_items=200_000, max_seq_len=256, embedding_dim=1024, num_heads=8,
                           num_layers=4),
                      dict(layout="jagged", num_negatives=512, num_clusters=512), 256),
            "xl": (dict(num_items=1_000_000, max_seq_len=256, embedding_dim=3072, num_heads=12,
                        num_layers=8, sparse_embeddings=True),
                   dict(layout="jagged", num_negatives=512, num_clusters=1024), 256),
        },
    ),
    "sasrec": _Spec(
        models.SASRec,
        models.SASRecConfig,
        SequenceDataConfig,
        {
            "tiny": (dict(num_items=500, max_seq_len=16, embedding_dim=32, num_heads=2),
                     dict(num_clusters=20), 32),
            "base": (dict(num_items=20_000, max_seq_len=50, embedding_dim=64, num_heads=2),
                     dict(num_negatives=128, num_clusters=128), 128),
            "large": (dict(num_items=200_000, max_seq_len=200, embedding_dim=1024, num_heads=8,
                           num_layers=4, ffn_multiplier=4),
                      dict(num_negatives=512, num_clusters=512), 256),
        },
    ),
}  # fmt: skip


@dataclass
class ZooSetup:
    """A model on its device with its data and task. `train_batches()` starts a fresh,
    deterministic, infinite iterator; `eval_batches(n)` is a fixed held-out list."""

    name: str
    preset: str
    model: nn.Module
    config: Any
    data_config: Any
    data: Any
    device: torch.device
    seed: int
    batch_size: int
    _loss: Callable[[nn.Module, Batch], torch.Tensor]
    _metrics: Callable[[nn.Module, list[Batch]], dict[str, float]]

    def train_batches(self) -> Iterator[Batch]:
        return self.data.train_batches()

    def eval_batches(self, n: int | None = None, *, split: str = "valid") -> list[Batch]:
        """The first n held-out batches of `split` ("valid" or "test"). n=None gives every
        batch of a finite dataset (Amazon) and 4 for a synthetic stream."""
        if n is None and not isinstance(self.data, amazon.AmazonStream):
            n = 4
        return self.data.eval_batches(n, split=split)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return self._loss(model, batch)

    def metrics(self, model: nn.Module, batches: list[Batch]) -> dict[str, float]:
        """CTR: logloss, ne, auc. Sequential: hr@10, ndcg@10, mrr."""
        return self._metrics(model, batches)

    def popularity_baseline(self) -> nn.Module:
        """Sequential setups only: a model that ranks candidates by training popularity."""
        if isinstance(self.data, amazon.AmazonStream):
            return models.PopularityModel(torch.from_numpy(self.data.counts)).to(self.device)
        if isinstance(self.data, SyntheticSequences):
            return models.PopularityModel(self.data.item_counts()).to(self.device)
        raise ValueError(f"{self.name} is not a sequential model")


def _split_overrides(spec: _Spec, overrides: dict[str, Any]) -> tuple[dict, dict]:
    model_fields = {f.name for f in dataclasses.fields(spec.config)}
    data_fields = {f.name for f in dataclasses.fields(spec.data_config)}
    unknown = sorted(set(overrides) - model_fields - data_fields)
    if unknown:
        raise TypeError(
            f"unknown override(s) {unknown}; {spec.config.__name__} takes {sorted(model_fields)} "
            f"and {spec.data_config.__name__} takes {sorted(data_fields)}"
        )
    model = {k: v for k, v in overrides.items() if k in model_fields}
    data = {k: v for k, v in overrides.items() if k in data_fields and k not in model_fields}
    return model, data


def _resolve(
    name: str, preset: str, batch_size: int | None, overrides: dict[str, Any]
) -> tuple[_Spec, dict[str, Any], Any, int]:
    """(spec, model config fields, data config, batch size) of a preset with overrides. The
    synthetic click data's config already follows the model (table sizes, sequence)."""
    if name not in SPECS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(SPECS)}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {list(PRESETS)}")
    spec = SPECS[name]
    if preset not in spec.presets:
        raise ValueError(f"{name} has no {preset!r} preset; choose one of {list(spec.presets)}")
    model_preset, data_preset, preset_batch = spec.presets[preset]
    model_overrides, data_overrides = _split_overrides(spec, overrides)
    batch_size = preset_batch if batch_size is None else batch_size
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    model_kwargs = {**model_preset, **model_overrides}
    if not issubclass(spec.data_config, SyntheticCriteoConfig):
        data_config = spec.data_config(**{**data_preset, **data_overrides})
        if data_config.dataset != "synthetic" and "num_items" in model_overrides:
            raise ValueError(
                f"num_items comes from the {data_config.dataset!r} data; do not override it"
            )
        return spec, model_kwargs, data_config, batch_size
    if "cardinalities" in data_overrides:
        raise ValueError("table sizes come from num_sparse and max_table_rows; set those")
    config = spec.config(**model_kwargs)
    # The data's shape follows the model: table sizes, and the sequence's vocabulary/width.
    derived = dict(cardinalities=config.cardinalities, num_dense=config.num_dense)
    if spec.data_config is SyntheticBehaviourConfig:
        derived.update(num_items=config.num_items, max_seq_len=config.max_seq_len)
    data_config = spec.data_config(**{**data_preset, **data_overrides, **derived})
    return spec, model_kwargs, data_config, batch_size


def preset_config(
    name: str, preset: str = "tiny", *, batch_size: int | None = None, **overrides: Any
) -> tuple[Any, Any, int]:
    """`(model config, data config, batch size)` that `create(name, preset, ...)` would use,
    building nothing. Amazon data sets are refused: their files set `num_items`."""
    spec, model_kwargs, data_config, batch_size = _resolve(name, preset, batch_size, overrides)
    if getattr(data_config, "dataset", "synthetic") != "synthetic":
        raise ValueError(f"the {data_config.dataset!r} data sets num_items: use create()")
    return spec.config(**model_kwargs), data_config, batch_size


def create(
    name: str,
    preset: str = "tiny",
    *,
    device: torch.device | str = "cpu",
    seed: int = 0,
    batch_size: int | None = None,
    **overrides: Any,
) -> ZooSetup:
    """Build model `name` ("dlrm", "dhen", "wukong", "interformer", "hstu", "sasrec") in a
    preset ("tiny", "base", "large"; "xl" for dhen, wukong, interformer and hstu) on
    `device`, with its data and task.

    `overrides` replace fields of the model config (e.g. `embedding_dim=32`) or of the data
    config (e.g. `layout="padded"`, `dataset="beauty"`). `seed` sets the model's
    initialization and the order of training data; held-out data depends only on the
    dataset (`teacher_seed`), so runs with different seeds are evaluated alike.
    """
    spec, model_kwargs, data_config, batch_size = _resolve(name, preset, batch_size, overrides)
    device = torch.device(device)
    if isinstance(data_config, SyntheticCriteoConfig):
        config = spec.config(**model_kwargs)
        stream = (
            SyntheticBehaviour
            if isinstance(data_config, SyntheticBehaviourConfig)
            else SyntheticCriteo
        )
        data: Any = stream(data_config, batch_size, device=device, seed=seed)
        loss, metrics = click_loss, click_metrics
    else:
        config, data = _sequence_data(spec, model_kwargs, data_config, batch_size, device, seed)
        loss, metrics = next_item_loss, next_item_metrics

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with device:
            model = spec.model(config)
    return ZooSetup(name, preset, model, config, data_config, data, device, seed, batch_size,
                    loss, metrics)  # fmt: skip


def _sequence_data(
    spec: _Spec,
    model_kwargs: dict[str, Any],
    data: SequenceDataConfig,
    batch_size: int,
    device: torch.device,
    seed: int,
) -> tuple[Any, Any]:
    if data.dataset == "synthetic":
        config = spec.config(**model_kwargs)
        stream = SyntheticSequences(
            SyntheticSequencesConfig(
                num_items=config.num_items,
                max_seq_len=config.max_seq_len,
                layout=data.layout,  # type: ignore[arg-type]
                num_negatives=data.num_negatives,
                num_eval_negatives=data.num_eval_negatives,
                num_clusters=min(data.num_clusters, config.num_items),
                teacher_seed=data.teacher_seed,
            ),
            batch_size,
            device=device,
            seed=seed,
        )
        return config, stream
    sequences = amazon.load_amazon(data.dataset, data.data_dir)
    config = spec.config(**{**model_kwargs, "num_items": sequences.num_items})
    stream = amazon.AmazonStream(
        sequences,
        batch_size=batch_size,
        max_seq_len=config.max_seq_len,
        layout=data.layout,  # type: ignore[arg-type]
        num_negatives=data.num_negatives,
        negative_sampling=data.negative_sampling,  # type: ignore[arg-type]
        num_eval_negatives=data.num_eval_negatives,
        device=device,
        seed=seed,
        eval_seed=data.teacher_seed,
    )
    return config, stream
