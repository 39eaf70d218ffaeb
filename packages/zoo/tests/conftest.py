"""One intra-op thread per test: the models are tiny, and on a shared 2-core machine (with
pytest-xdist workers beside us) extra threads only spin against each other."""

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
