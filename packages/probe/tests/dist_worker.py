"""One rank of the gloo test: `python dist_worker.py RANK WORLD INIT_FILE OUT_DIR`."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

from loka.probe import Probe, ProbeConfig


def main(rank: int, world: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(0)  # the same model on every rank
    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 16))
    data = torch.Generator().manual_seed(100 + rank)  # each rank sees its own batches
    config = ProbeConfig(every=1, warmup_steps=0, rows=32, queue_size=16)
    with Probe(model, config) as probe:
        for _ in range(4 + rank):  # ranks need not agree on the number of steps
            x = torch.randn(96, 64, generator=data) * (1 + rank)
            model(x).square().mean().backward()
            probe.step()
        paths = probe.save(f"{out}/rank{rank}")  # collective: merges across ranks
        assert probe.errors == [], probe.errors
    print(sorted(str(p) for p in paths.values()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
