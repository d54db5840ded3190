"""Parallel I/O and data-pipeline helpers."""

from .sample_random import SampleRandom

__all__ = ["SampleRandom"]
