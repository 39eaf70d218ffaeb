"""How much GPU memory a pack of LoRA jobs needs: weights, adapter states, activations."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from loka.plora.config import LoraJobConfig, pack_rows
from loka.plora.plan.shape import ModelShape

GIB = 1024**3


@dataclass(frozen=True)
class MemoryModel:
    """Peak memory of one packed training step, in bytes, as a sum of named parts.

    - base weights: every base parameter in `weight_bytes` (bf16: 2), shared by the pack;
    - per job: its adapter parameters, their gradients (both `adapter_bytes`) and AdamW's
      two moments (`optimizer_bytes` per parameter), plus the copy of the factors in the
      activation dtype that the packed GEMMs read;
    - activations: `activation_bytes_per_token` for each token of the packed batch (each
      job's tokens as `loka.plora.config.pack_rows` lays them out, its rows' pads included),
      plus the adapters' rank-sized intermediates; the default per-token figure is an
      analytic estimate for Llama layers with LoRA on every linear and the logits of the
      loss, and `calibrated` replaces it by measured peaks;
    - attention_mask (only when there is one): when a pack mixes lengths and some row holds
      several samples, the `[rows, row_len, row_len]` mask that keeps attention within a
      sample (a boolean and its additive copy in the activation dtype);
    - workspace: CUDA context, cuBLAS workspace and allocator slack.
    """

    shape: ModelShape
    seq_len: int
    weight_bytes: int = 2
    adapter_bytes: int = 4
    optimizer_bytes: int = 8
    activation_dtype_bytes: int = 2
    activation_bytes_per_token: float | None = None
    workspace_bytes: int = 2 * GIB
    source: str = "analytic"

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {self.seq_len}")

    def per_token_bytes(self) -> float:
        if self.activation_bytes_per_token is not None:
            return self.activation_bytes_per_token
        s, b = self.shape, self.activation_dtype_bytes
        q = s.num_heads * s.head_dim
        kv = s.num_kv_heads * s.head_dim
        # Kept for backward per layer and token: two RMSNorm inputs in fp32 and outputs,
        # q/k/v after RoPE, the attention output and its log-sum-exp, the MLP's gate, up,
        # activation and product; the residual stream itself is not kept.
        per_layer = 2 * (4 + b) * s.hidden + b * (2 * q + 2 * kv) + b * q + 4 * s.num_heads
        per_layer += 4 * b * s.intermediate
        # The loss: bf16 logits, their fp32 copy, the fp32 and bf16 gradients.
        logits = (2 * b + 8) * s.vocab
        return float(s.num_layers * per_layer + logits)

    def job_state_bytes(self, job: LoraJobConfig) -> int:
        return job.rank * self.job_state_bytes_per_rank()

    def job_state_bytes_per_rank(self) -> int:
        """A job's adapter state bytes per unit of rank (they are linear in the rank)."""
        params = self.shape.adapter_params(1)
        return params * (
            2 * self.adapter_bytes + self.optimizer_bytes + self.activation_dtype_bytes
        )

    def breakdown(self, jobs: Sequence[LoraJobConfig]) -> dict[str, int]:
        """Bytes per part for a pack of `jobs` running together."""
        rows = pack_rows(jobs, self.seq_len)
        tokens = sum(rows.tokens)
        rank_tokens = sum(job.rank * t for job, t in zip(jobs, rows.tokens, strict=True))
        mask = 0
        if rows.shares_rows:
            mask = tokens * rows.row_len * (1 + self.activation_dtype_bytes)
        lora_intermediates = (
            rank_tokens
            * self.shape.num_layers
            * len(self.shape.target_modules)
            * 2
            * self.activation_dtype_bytes
        )
        per_rank = self.job_state_bytes_per_rank()
        parts = {
            "base_weights": self.shape.num_params * self.weight_bytes,
            "adapter_states": per_rank * sum(job.rank for job in jobs),
            "activations": int(tokens * self.per_token_bytes()) + lora_intermediates,
            "workspace": self.workspace_bytes,
        }
        if mask:
            parts["attention_mask"] = mask
        return parts

    def pack_bytes(self, jobs: Sequence[LoraJobConfig]) -> int:
        return sum(self.breakdown(jobs).values())

    def calibrated(
        self, profiles: Sequence[Mapping[str, Any]], jobs_of: Sequence[Sequence[LoraJobConfig]]
    ) -> MemoryModel:
        """A copy whose per-token activation bytes come from measured peaks.

        profiles: records with `tokens` and `peak_memory_bytes` (see
        `loka.plora.StepProfile`); jobs_of: the jobs of each profiled pack. The
        largest per-token figure is kept, so the model errs on the side of fitting.
        """
        if len(profiles) != len(jobs_of) or not profiles:
            raise ValueError("calibrated needs one job list per profile, and at least one profile")
        per_token = []
        for record, jobs in zip(profiles, jobs_of, strict=True):
            if not record.get("peak_memory_bytes"):
                continue
            fixed = self.breakdown(jobs)
            static = fixed["base_weights"] + fixed["adapter_states"]
            per_token.append((record["peak_memory_bytes"] - static) / max(1, record["tokens"]))
        if not per_token:
            raise ValueError("no profile has a measured peak memory (profiles from a GPU do)")
        return replace(
            self,
            activation_bytes_per_token=max(max(per_token), 0.0),
            # The allocator's peak holds the cuBLAS workspace, not the CUDA context or the
            # caching allocator's fragmentation: keep 1 GiB for those.
            workspace_bytes=GIB,
            source=f"calibrated on {len(per_token)} measured peaks",
        )
