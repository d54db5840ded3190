"""Distributed sparse dictionary learning: sparse coders, the online and MOD learners, results files."""

from .coding import correlations_of, gram_matrix, lasso_encode, lasso_encode_gram, omp_encode, omp_encode_gram
from .config import DictLearnConfig, load_config

__all__ = [
    "DictLearnConfig",
    "correlations_of",
    "gram_matrix",
    "lasso_encode",
    "lasso_encode_gram",
    "load_config",
    "omp_encode",
    "omp_encode_gram",
]
