"""The synthetic Criteo-like stream plus a behaviour sequence per example (for InterFormer).

Each example keeps the Criteo-like dense and categorical features and gains `sequence`, the
user's recent items `[B, L]`, left-padded with 0 (most recent last). Items come from
interest clusters (`ItemClusters`, as in the synthetic sequences): the user drifts from a
first cluster, which half the time follows a profile feature (`profile_feature`), to a
second one. The click logit mixes the Criteo teacher with a sequence term: the affinity
between the clusters of the user's items, weighted towards the most recent, and the
candidate's category (the cluster that `candidate_feature`'s id maps to), plus a
per-cluster appeal of the items alone. Predicting clicks well thus needs the sequence and
the non-sequence features together, which is what InterFormer's two arms exchange.
`oracle_logits(batch)` is the teacher's logit, including the sequence term.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from loka.zoo.data.criteo import (
    _CALIBRATION_SAMPLES,
    SyntheticCriteo,
    SyntheticCriteoConfig,
    _bias_for_rate,
    _Dataset,
    _mix_terms,
    _sample_features,
    _teacher_terms,
)
from loka.zoo.data.seeding import CALIBRATION_STREAM, generator, stream_seed
from loka.zoo.data.sequences import ItemClusters, drifting_items

_CATEGORY_PRIME = 2246822519  # maps a categorical id to an item cluster


@dataclass(frozen=True)
class SyntheticBehaviourConfig(SyntheticCriteoConfig):
    num_items: int = 1000  # sequence vocabulary: ids 1..num_items, 0 pads
    max_seq_len: int = 16  # L: width of `sequence`
    min_seq_len: int = 4
    num_clusters: int = 16
    sequence_share: float = 0.4  # share of the teacher logit's variance from the sequence
    sequence_noise: float = 0.2  # probability that an item comes from a random cluster
    profile_share: float = 0.5  # probability that the first interest follows the profile
    recency: float = 0.8  # weight decay per step back in the sequence term
    zipf_alpha: float = 1.2
    # The features that name the candidate's category and the user's profile (first ids;
    # taken modulo the number of features). Criteo's feature 5 has 24 ids: a category.
    candidate_feature: int = 5
    profile_feature: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_items", "max_seq_len", "min_seq_len", "num_clusters"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.min_seq_len > self.max_seq_len:
            raise ValueError(
                f"min_seq_len {self.min_seq_len} exceeds max_seq_len {self.max_seq_len}"
            )
        if self.num_clusters > self.num_items:
            raise ValueError(f"num_clusters must be in [1, num_items], got {self.num_clusters}")
        for name in ("sequence_share", "sequence_noise", "profile_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not 0.0 < self.recency <= 1.0:
            raise ValueError(f"recency must be in (0, 1], got {self.recency}")
        if self.zipf_alpha <= 0.0 or self.zipf_alpha == 1.0:
            raise ValueError(f"zipf_alpha must be positive and not 1, got {self.zipf_alpha}")
        for name in ("candidate_feature", "profile_feature"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be non-negative, got {getattr(self, name)}")


@dataclass
class _Behaviour:
    """The fixed parameters of the sequence side: item clusters and the sequence teacher."""

    cluster_of: torch.Tensor  # [num_items + 1] cluster of each item id
    affinity: torch.Tensor  # [C, C]: item cluster x candidate category
    appeal: torch.Tensor  # [C]: how clickable a user of each cluster is, whatever the candidate
    category_shifts: torch.Tensor  # [2] scrambles for the candidate and the profile
    term_mean: torch.Tensor  # [] standardizes the sequence term
    term_std: torch.Tensor  # []
    bias: torch.Tensor  # [] sets the mean click rate of the mixed logit

    def to(self, device: torch.device) -> _Behaviour:
        return _Behaviour(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


class SyntheticBehaviour(SyntheticCriteo):
    """Infinite, deterministic stream of Criteo-like batches with a behaviour sequence:
    `{"dense": float32 [B, D], "sparse": int64 [B, F, bag], "sequence": int64 [B, L],
    "label": float32 [B]}`."""

    config: SyntheticBehaviourConfig

    def __init__(
        self,
        config: SyntheticBehaviourConfig,
        batch_size: int,
        *,
        device: torch.device | str = "cpu",
        seed: int = 0,
    ) -> None:
        super().__init__(config, batch_size, device=device, seed=seed)
        g = torch.Generator().manual_seed(stream_seed(config.teacher_seed, CALIBRATION_STREAM, 1))
        self._clusters = ItemClusters(
            config.num_items,
            config.num_clusters,
            int(torch.randint(config.num_items, (), generator=g)),
            config.zipf_alpha,
        )
        behaviour = _Behaviour(
            cluster_of=self._clusters.cluster_of(),
            # Liking the candidate's own category counts most; the rest is random.
            affinity=torch.randn(config.num_clusters, config.num_clusters, generator=g)
            + 2.0 * torch.eye(config.num_clusters),
            appeal=torch.randn(config.num_clusters, generator=g),
            category_shifts=torch.randint(0, 1 << 30, (2,), generator=g),
            term_mean=torch.zeros(()),
            term_std=torch.ones(()),
            bias=torch.zeros(()),
        )
        self._behaviour = behaviour
        cpu = self._dataset.to(torch.device("cpu"))
        dense, sparse = _sample_features(cpu, _CALIBRATION_SAMPLES, self.bag_size, g)
        sequence = self._sequences(sparse, g)
        terms = self._sequence_term(sequence, sparse)
        behaviour.term_mean, behaviour.term_std = terms.mean(), terms.std().clamp_min(1e-6)
        logits = self._mixed_logits(cpu, dense, sparse, sequence).double()
        behaviour.bias = _bias_for_rate(logits, config.positive_rate).float()
        self._behaviour = behaviour.to(self.device)

    def oracle_logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The teacher's logits, sequence term included: the best any model can predict."""
        logits = self._mixed_logits(self._dataset, batch["dense"], batch["sparse"],
                                    batch["sequence"])  # fmt: skip
        return self._behaviour.bias + logits

    def _draw(self, seed: int, stream: int, index: int) -> dict[str, torch.Tensor]:
        g = generator(self.device, seed, stream, index)
        dense, sparse = _sample_features(self._dataset, self.batch_size, self.bag_size, g)
        sequence = self._sequences(sparse, g)
        logits = self._behaviour.bias + self._mixed_logits(self._dataset, dense, sparse, sequence)
        label = torch.bernoulli(torch.sigmoid(logits), generator=g)
        return {"dense": dense, "sparse": sparse, "sequence": sequence, "label": label}

    def _categories(self, sparse: torch.Tensor, role: int) -> torch.Tensor:
        """The item cluster that the first id of the candidate (role 0) or profile (role 1)
        feature of each example maps to."""
        feature = (self.config.candidate_feature, self.config.profile_feature)[role]
        ids = sparse[:, feature % sparse.size(1), 0]
        shift = self._behaviour.category_shifts.to(sparse.device)[role]
        return (ids * _CATEGORY_PRIME + shift) % self.config.num_clusters

    def _sequences(self, sparse: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        cfg, dev, batch = self.config, sparse.device, sparse.size(0)
        lengths = torch.randint(
            cfg.min_seq_len, cfg.max_seq_len + 1, (batch, 1), generator=g, device=dev
        )
        profile = self._categories(sparse, 1).view(-1, 1)
        follows = torch.rand(batch, 1, generator=g, device=dev) < cfg.profile_share
        random_first, second = torch.randint(
            cfg.num_clusters, (2, batch, 1), generator=g, device=dev
        )
        first = torch.where(follows, profile, random_first)
        return drifting_items(
            self._clusters, first, second, lengths, cfg.max_seq_len, cfg.sequence_noise, g
        )

    def _sequence_term(self, sequence: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        """Recency-weighted affinity of the user's item clusters to the candidate's category,
        plus the clusters' own appeal."""
        behaviour = self._behaviour
        if behaviour.cluster_of.device != sequence.device:
            behaviour = behaviour.to(sequence.device)
        candidate = self._categories(sparse, 0).view(-1, 1)
        cluster = behaviour.cluster_of[sequence]
        affinity = behaviour.affinity[cluster, candidate] + behaviour.appeal[cluster]  # [B, L]
        length = sequence.size(1)
        from_end = torch.arange(length - 1, -1, -1, device=sequence.device, dtype=torch.float32)
        weight = self.config.recency**from_end * (sequence != 0)
        return (affinity * weight).sum(1) / weight.sum(1).clamp_min(1e-6)

    def _mixed_logits(
        self, dataset: _Dataset, dense: torch.Tensor, sparse: torch.Tensor, sequence: torch.Tensor
    ) -> torch.Tensor:
        """The teacher logit without its bias: the Criteo terms and the sequence term, each
        standardized, mixed by `sequence_share` of the variance."""
        share = self.config.sequence_share
        behaviour = self._behaviour
        criteo = _mix_terms(dataset, _teacher_terms(dataset, dense, sparse), 1.0)
        term = self._sequence_term(sequence, sparse)
        term = (term - behaviour.term_mean.to(term.device)) / behaviour.term_std.to(term.device)
        return self.config.teacher_signal * ((1 - share) ** 0.5 * criteo + share**0.5 * term)
