"""Distributed sparse dictionary learning: sparse coding now; the learning job comes next."""

from .coding import omp_encode, omp_encode_gram

__all__ = ["omp_encode", "omp_encode_gram"]
