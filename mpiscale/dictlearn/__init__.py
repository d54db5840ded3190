"""Distributed sparse dictionary learning: sparse coders, the online and MOD learners, results files."""

from .atom_usage import format_top_inputs, top_inputs
from .coding import correlations_of, gram_matrix, lasso_encode, lasso_encode_gram, omp_encode, omp_encode_gram
from .config import DictLearnConfig, load_config
from .results import RESULTS_FORMAT

__all__ = [
    "RESULTS_FORMAT",
    "DictLearnConfig",
    "format_top_inputs",
    "correlations_of",
    "gram_matrix",
    "lasso_encode",
    "lasso_encode_gram",
    "load_config",
    "omp_encode",
    "omp_encode_gram",
    "top_inputs",
]
