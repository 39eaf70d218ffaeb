"""Kernel benchmarking for the planner: candidates, per-pass timing on the GPU, the cache
of measured rows per machine, and the cost model that estimates where the GPU is absent."""

from loka.dispatch.bench.cache import BenchCache, CacheMismatchError, default_cache_dir
from loka.dispatch.bench.candidates import Candidate, candidates, m_bucket, speed_key
from loka.dispatch.bench.cost_model import CostModel
from loka.dispatch.bench.runner import (
    BenchResult,
    Shape,
    benchmark,
    can_measure,
    site_norm_shapes,
    site_producer_shapes,
    site_recipes,
    site_shapes,
)
from loka.dispatch.bench.timing import PassTimer, PassTiming

__all__ = [
    "BenchCache",
    "BenchResult",
    "CacheMismatchError",
    "Candidate",
    "CostModel",
    "PassTimer",
    "PassTiming",
    "Shape",
    "benchmark",
    "can_measure",
    "candidates",
    "default_cache_dir",
    "m_bucket",
    "site_norm_shapes",
    "site_producer_shapes",
    "site_recipes",
    "site_shapes",
    "speed_key",
]
