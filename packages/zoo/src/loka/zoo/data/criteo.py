"""A synthetic Criteo-like click stream, generated on the target device.

Each sample has 13 dense features (log1p of zero-inflated log-normal counts, as DLRM's
preprocessing gives them), 26 categorical features with power-law ids over Criteo's table
sizes in multi-hot bags, and a click label drawn from a fixed random teacher model, so
that what a student learns, and what a precision change costs, is measurable against the
teacher's own (oracle) log loss.

The dataset (feature distributions and teacher) depends only on `teacher_seed` and is
identical on every device; batch i of a stream is drawn with its own generator on the
target device, so it is deterministic per (device type, seed, i) and costs a few kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from loka.zoo.data.seeding import (
    CALIBRATION_STREAM,
    TRAIN_STREAM,
    generator,
    split_stream,
    stream_seed,
    zipf_ids,
)
from loka.zoo.data.stream import BatchStream

# Table sizes of the 26 categorical features of Criteo's Display Advertising Challenge.
CRITEO_CARDINALITIES: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip

# A prime above every table size: multiplying by it permutes ids, so hot ids spread over
# the table instead of sitting at its start.
_SCRAMBLE_PRIME = 2654435761
_CALIBRATION_SAMPLES = 16384
# Share of the teacher logit's variance from first-order, pairwise (FM) and MLP terms.
_TEACHER_MIX = (0.5, 0.3, 0.2)


def criteo_cardinalities(num_sparse: int = 26, max_rows: int | None = None) -> tuple[int, ...]:
    """Criteo's table sizes, cycled to `num_sparse` features and capped at `max_rows`."""
    if num_sparse <= 0:
        raise ValueError(f"num_sparse must be positive, got {num_sparse}")
    sizes = [CRITEO_CARDINALITIES[i % len(CRITEO_CARDINALITIES)] for i in range(num_sparse)]
    if max_rows is not None:
        sizes = [min(size, max_rows) for size in sizes]
    return tuple(sizes)


@dataclass(frozen=True)
class SyntheticCriteoConfig:
    cardinalities: tuple[int, ...] = CRITEO_CARDINALITIES
    num_dense: int = 13
    max_bag_size: int = 4  # longest multi-hot bag; 1 makes every feature one-hot
    positive_rate: float = 0.25  # mean click rate the teacher is calibrated to
    teacher_signal: float = 2.0  # std of the teacher logit: higher is easier to learn
    teacher_dim: int = 8
    teacher_hidden: int = 32
    teacher_seed: int = 0  # names the dataset: features and teacher

    def __post_init__(self) -> None:
        if not self.cardinalities or any(int(c) < 1 for c in self.cardinalities):
            raise ValueError(f"cardinalities must be positive, got {self.cardinalities}")
        if max(self.cardinalities) >= _SCRAMBLE_PRIME:
            raise ValueError(f"a table of {max(self.cardinalities)} rows is too large")
        for name in ("num_dense", "max_bag_size", "teacher_dim", "teacher_hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0.0 < self.positive_rate < 1.0:
            raise ValueError(f"positive_rate must be in (0, 1), got {self.positive_rate}")
        if self.teacher_signal <= 0.0:
            raise ValueError(f"teacher_signal must be positive, got {self.teacher_signal}")


@dataclass
class _Dataset:
    """The fixed parameters of one synthetic dataset: feature distributions and teacher."""

    sizes: torch.Tensor  # [F] int64
    row_offsets: torch.Tensor  # [F] int64, into the teacher's concatenated table
    alpha: torch.Tensor  # [F] Zipf exponent per feature
    bag_len: torch.Tensor  # [F] longest bag per feature
    shift: torch.Tensor  # [F] id scramble offset
    dense_mu: torch.Tensor  # [D]
    dense_sigma: torch.Tensor  # [D]
    dense_zero: torch.Tensor  # [D] probability of a zero count
    table: torch.Tensor  # [rows + 1, t], row 0 is padding
    first_order: torch.Tensor  # [F, t]
    dense_weight: torch.Tensor  # [D]
    hidden_weight: torch.Tensor  # [D + F * t, H]
    out_weight: torch.Tensor  # [H]
    dense_mean: torch.Tensor  # [D], standardizes the teacher's dense input
    dense_std: torch.Tensor  # [D]
    term_mean: torch.Tensor  # [3], standardizes the three teacher terms
    term_std: torch.Tensor  # [3]
    mix: torch.Tensor  # [3], weights of the standardized terms (variance shares, unit sum)
    bias: torch.Tensor  # [], sets the mean click rate

    def to(self, device: torch.device) -> _Dataset:
        return _Dataset(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def _build_dataset(config: SyntheticCriteoConfig) -> _Dataset:
    g = torch.Generator().manual_seed(stream_seed(config.teacher_seed, CALIBRATION_STREAM, 0))
    n_sparse, n_dense, dim = len(config.cardinalities), config.num_dense, config.teacher_dim
    sizes = torch.tensor(config.cardinalities, dtype=torch.int64)
    # Most Criteo features are one-hot; about a third get multi-hot bags.
    multi_hot = torch.rand(n_sparse, generator=g) < 1.0 / 3.0
    longest = torch.randint(2, max(config.max_bag_size, 2) + 1, (n_sparse,), generator=g)
    bag_len = torch.where(multi_hot & (config.max_bag_size > 1), longest, 1)
    rows = int(sizes.sum())
    table = torch.randn(rows + 1, dim, generator=g)
    table[0] = 0.0
    dataset = _Dataset(
        sizes=sizes,
        row_offsets=torch.cumsum(sizes, 0) - sizes,
        alpha=1.05 + 0.35 * torch.rand(n_sparse, generator=g, dtype=torch.float64),
        bag_len=bag_len,
        shift=torch.randint(0, 1 << 30, (n_sparse,), generator=g),
        dense_mu=3.0 * torch.rand(n_dense, generator=g),
        dense_sigma=0.5 + 1.5 * torch.rand(n_dense, generator=g),
        dense_zero=0.4 * torch.rand(n_dense, generator=g),
        table=table,
        first_order=torch.randn(n_sparse, dim, generator=g),
        dense_weight=torch.randn(n_dense, generator=g),
        hidden_weight=torch.randn(n_dense + n_sparse * dim, config.teacher_hidden, generator=g)
        * (n_dense + n_sparse * dim) ** -0.5,
        out_weight=torch.randn(config.teacher_hidden, generator=g),
        dense_mean=torch.zeros(n_dense),
        dense_std=torch.ones(n_dense),
        term_mean=torch.zeros(3),
        term_std=torch.ones(3),
        mix=torch.tensor(_TEACHER_MIX).sqrt() / torch.tensor(_TEACHER_MIX).sum().sqrt(),
        bias=torch.zeros(()),
    )
    dense, sparse = _sample_features(dataset, _CALIBRATION_SAMPLES, int(bag_len.max()), g)
    dataset.dense_mean, dataset.dense_std = dense.mean(0), dense.std(0).clamp_min(1e-6)
    terms = _teacher_terms(dataset, dense, sparse)
    dataset.term_mean, dataset.term_std = terms.mean(0), terms.std(0).clamp_min(1e-6)
    logits = _mix_terms(dataset, terms, config.teacher_signal).double()
    dataset.bias = _bias_for_rate(logits, config.positive_rate).float()
    return dataset


def _bias_for_rate(logits: torch.Tensor, rate: float) -> torch.Tensor:
    low, high = torch.tensor(-30.0, dtype=torch.float64), torch.tensor(30.0, dtype=torch.float64)
    for _ in range(60):
        mid = (low + high) / 2
        too_high = torch.sigmoid(logits + mid).mean() > rate
        low, high = torch.where(too_high, low, mid), torch.where(too_high, mid, high)
    return (low + high) / 2


def _sample_features(
    dataset: _Dataset, batch_size: int, bag: int, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense and sparse features; `bag` (the longest bag) is passed in: reading it from the
    device would cost a sync per batch."""
    device = dataset.sizes.device
    n_dense, n_sparse = dataset.dense_mu.numel(), dataset.sizes.numel()
    normal = torch.randn(batch_size, n_dense, generator=g, device=device)
    counts = torch.exp(dataset.dense_mu + dataset.dense_sigma * normal)
    missing = torch.rand(batch_size, n_dense, generator=g, device=device) < dataset.dense_zero
    dense = torch.log1p(counts.masked_fill(missing, 0.0))

    uniform = torch.rand(batch_size, n_sparse, bag, generator=g, device=device)
    sizes = dataset.sizes.view(1, -1, 1)
    ids = zipf_ids(uniform, sizes, dataset.alpha.view(1, -1, 1))
    ids = (ids * _SCRAMBLE_PRIME + dataset.shift.view(1, -1, 1)) % sizes
    fill = torch.rand(batch_size, n_sparse, generator=g, device=device)
    lengths = 1 + (fill * dataset.bag_len).long()
    slots = torch.arange(bag, device=device).view(1, 1, -1)
    sparse = ids.masked_fill(slots >= lengths.unsqueeze(-1), -1)
    return dense, sparse


def _teacher_terms(dataset: _Dataset, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
    """The teacher's first-order, pairwise (FM) and MLP terms, `[B, 3]`, unstandardized."""
    batch, n_sparse, bag = sparse.shape
    rows = torch.where(sparse >= 0, sparse + 1 + dataset.row_offsets.view(1, -1, 1), 0)
    pooled = F.embedding_bag(
        rows.reshape(batch * n_sparse, bag), dataset.table, mode="mean", padding_idx=0
    ).view(batch, n_sparse, -1)
    dense_z = (dense - dataset.dense_mean) / dataset.dense_std
    first = (pooled * dataset.first_order).sum((1, 2)) + dense_z @ dataset.dense_weight
    total = pooled.sum(1)
    pairwise = 0.5 * (total.square() - pooled.square().sum(1)).sum(-1)
    hidden = torch.tanh(torch.cat([dense_z, pooled.flatten(1)], 1) @ dataset.hidden_weight)
    return torch.stack([first, pairwise, hidden @ dataset.out_weight], dim=1)


def _mix_terms(dataset: _Dataset, terms: torch.Tensor, signal: float) -> torch.Tensor:
    standardized = (terms - dataset.term_mean) / dataset.term_std
    return signal * (standardized * dataset.mix).sum(1)


class SyntheticCriteo(BatchStream):
    """Infinite, deterministic stream of Criteo-like batches on `device`.

    A batch is `{"dense": float32 [B, D], "sparse": int64 [B, F, L] (local ids, -1 pads
    each bag's tail), "label": float32 [B]}`.
    """

    def __init__(
        self,
        config: SyntheticCriteoConfig,
        batch_size: int,
        *,
        device: torch.device | str = "cpu",
        seed: int = 0,
    ) -> None:
        super().__init__(config, batch_size, device=device, seed=seed)
        dataset = _build_dataset(config)
        self.bag_size = int(dataset.bag_len.max())
        self._dataset = dataset.to(self.device)

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        return self._draw(self.seed, TRAIN_STREAM, index)

    def eval_batch(self, index: int, *, split: str = "valid") -> dict[str, torch.Tensor]:
        return self._draw(self.config.teacher_seed, split_stream(split), index)

    def oracle_logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The teacher's logits for a batch: the best any model can predict."""
        return self._logits(batch["dense"], batch["sparse"])

    def _draw(self, seed: int, stream: int, index: int) -> dict[str, torch.Tensor]:
        g = generator(self.device, seed, stream, index)
        dense, sparse = _sample_features(self._dataset, self.batch_size, self.bag_size, g)
        clicks = torch.sigmoid(self._logits(dense, sparse))
        label = torch.bernoulli(clicks, generator=g)
        return {"dense": dense, "sparse": sparse, "label": label}

    def _logits(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        terms = _teacher_terms(self._dataset, dense, sparse)
        return self._dataset.bias + _mix_terms(self._dataset, terms, self.config.teacher_signal)
