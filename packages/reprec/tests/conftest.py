"""The REPREC tests train tiny models (SASRec, a small Llama, the injector): one intra-op
thread each, so that pytest-xdist workers on a 2-core machine do not spin against each other
(as in loka-zoo's tests, where these tests lived)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
