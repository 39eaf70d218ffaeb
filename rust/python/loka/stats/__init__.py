"""Streaming statistics of sampled tensors (Rust core)."""

from loka.stats import _native  # noqa: F401

__all__: list[str] = []
