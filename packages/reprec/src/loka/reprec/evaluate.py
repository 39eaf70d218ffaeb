"""Leave-one-out ranking of the held-out item among its fixed negatives: HR@K and NDCG@K
(K = 5 and 10 by default) and MRR overall and per activity group (cold 1-5, medium 6-20, warm 21+ interactions)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from loka.reprec.examples import ACTIVITY_GROUPS, EvalSet, activity_group
from loka.zoo.metrics import ranking_metrics

Scorer = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (history, candidates) -> scores


@torch.no_grad()
def score_eval_set(
    scorer: Scorer,
    eval_set: EvalSet,
    *,
    device: torch.device | str = "cpu",
    max_prompts: int = 4096,
    autocast_dtype: torch.dtype | None = None,
    on_batch: Callable[[int, int], None] | None = None,
) -> torch.Tensor:
    """Scores `[users, candidates]` of `scorer(history [b, L], candidates [b, C]) -> [b, C]`
    in chunks of about `max_prompts` (user, candidate) pairs."""
    device = torch.device(device)
    count = eval_set.candidates.size(1)
    chunk = max(1, max_prompts // count)
    users = len(eval_set.users)
    modules = [scorer] if isinstance(scorer, nn.Module) else []
    modes = [m.training for m in modules]
    for m in modules:
        m.eval()
    try:
        out = []
        for start in range(0, users, chunk):
            rows = slice(start, start + chunk)
            with torch.autocast(
                device.type,
                dtype=autocast_dtype or torch.bfloat16,
                enabled=autocast_dtype is not None,
            ):
                scores = scorer(
                    eval_set.history[rows].to(device), eval_set.candidates[rows].to(device)
                )
            out.append(scores.float().cpu())
            if on_batch is not None:
                on_batch(min(start + chunk, users), users)
    finally:
        for m, mode in zip(modules, modes, strict=True):
            m.train(mode)
    return torch.cat(out)


def grouped_metrics(
    scores: torch.Tensor, activity: np.ndarray, *, ks: Sequence[int] = (5, 10)
) -> dict[str, dict[str, float]]:
    """`{"all" | "cold" | "medium" | "warm": {"users", "hr@k", "ndcg@k" for each k in
    `ks`, "mrr"}}` for scores `[U, C]` (target in column 0); groups without users are left
    out."""
    if len(activity) != scores.size(0):
        raise ValueError(f"{len(activity)} activity counts for {scores.size(0)} score rows")
    if not ks:
        raise ValueError("ks must name at least one cut-off")

    def metrics(rows: torch.Tensor) -> dict[str, float]:
        out: dict[str, float] = {}
        for k in ks:
            out.update(ranking_metrics(rows, k))
        mrr = out.pop("mrr")
        return {**out, "mrr": mrr}

    groups = activity_group(np.asarray(activity))
    result = {"all": {"users": float(scores.size(0)), **metrics(scores)}}
    for name in ACTIVITY_GROUPS:
        rows = torch.from_numpy(groups == name)
        if bool(rows.any()):
            result[name] = {"users": float(rows.sum()), **metrics(scores[rows])}
    return result
