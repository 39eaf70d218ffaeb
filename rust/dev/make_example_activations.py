"""Regenerate loka/stats/data/example_activations.npy, the bundled demo input.

256 tokens x 512 channels of float32 post-norm activations with what real LLM/LRM
activations show: per-token scale variation, a few outlier channels (tens of times larger,
as in LLM.int8()), a sparse set of zeros after a ReLU-like gate, and one spiky token.
"""

from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[1] / "python/loka/stats/data/example_activations.npy"


def make(seed: int = 20261129) -> np.ndarray:
    rng = np.random.default_rng(seed)
    tokens, channels = 256, 512
    x = rng.standard_normal((tokens, channels)) * rng.lognormal(0.0, 0.5, (tokens, 1))
    outliers = rng.choice(channels, 6, replace=False)
    x[:, outliers] *= rng.uniform(20.0, 80.0, 6)
    x[rng.random((tokens, channels)) < 0.1] = 0.0
    x[17] *= 40.0
    return x.astype(np.float32)


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    tmp = OUT.with_suffix(".tmp.npy")
    np.save(tmp, make())
    tmp.replace(OUT)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")
