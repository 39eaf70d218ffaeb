"""Bad input to `loka demo`, `loka bench --shapes` and a closed `Session`: one line naming the
problem, before any training or timing starts."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before loka.kernels is imported

import pytest
import torch
from torch import nn

DEMO = [
    (("--device", "tpu"), "not a torch device"),
    (("--device", "foo:x"), "not a torch device"),
    (("--bench-budget-s", "-1"), "--bench-budget-s must be a positive"),
    (("--bench-budget-s", "0"), "--bench-budget-s must be a positive"),
    (("--bench-budget-s", "nan"), "--bench-budget-s must be a positive"),
    (("--out", "/proc/no-such-dir/out"), "--out /proc/no-such-dir/out: cannot create it"),
    (("--kernel-bench", "/no/such/table.parquet"), "--kernel-bench: no such file"),
    (("--steps", "-3"), "--steps must be positive"),
    (("--warmup-steps", "0"), "--warmup-steps must be positive"),
    (("--model", "nosuch"), "unknown model 'nosuch'"),
]
if not torch.cuda.is_available():
    DEMO.append((("--device", "cuda"), "no CUDA GPU is available here"))


@pytest.mark.parametrize(("argv", "needle"), DEMO)
def test_demo_refuses_before_training(loka, argv, needle):
    assert needle in loka("demo", *argv)


SHAPES = [
    ("100000000x100000x4096", "beyond what one GPU can time"),
    ("16384x1024x0", "non-positive size"),
    ("16384x1024", "is not MxKxN"),
    ("axbxc", "is not MxKxN"),
    ("131072x65536x4096", "beyond what one GPU can time"),
]


@pytest.mark.parametrize(("shapes", "needle"), SHAPES)
def test_bench_refuses_absurd_shapes(loka, shapes, needle):
    assert needle in loka("bench", "--shapes", shapes)


def test_session_step_after_close_in_warmup_says_so():
    from loka.dispatch import Session, SessionConfig

    session = Session(nn.Sequential(nn.Linear(16, 16)), SessionConfig(warmup_steps=5))
    session.close()
    with pytest.raises(RuntimeError, match=r"after close\(\)"):
        session.step()
    with pytest.raises(RuntimeError, match=r"after close\(\)"):
        session.plan_and_apply()
