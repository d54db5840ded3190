"""Distributed sparse dictionary learning: sparse coders, the online and MOD learners, the estimator, results and
codes files.

Names are loaded on first use: the command line reads the settings without importing the numba kernels.
"""

from ..lazy_exports import lazy_exports

# name -> the module of this package that defines it
_PUBLIC = {
    "RESULTS_FORMAT": "results",
    "DictLearnConfig": "config",
    "EncodeConfig": "config",
    "CODES_FORMAT": "codes",
    "SparseCodes": "codes",
    "load_codes": "codes",
    "DictionaryLearning": "estimator",
    "LearnedDictionary": "results",
    "load_results": "results",
    "load_config": "config",
    "format_top_inputs": "atom_usage",
    "top_inputs": "atom_usage",
    "correlations_of": "coding",
    "gram_matrix": "coding",
    "lasso_encode": "coding",
    "lasso_encode_gram": "coding",
    "omp_encode": "coding",
    "omp_encode_gram": "coding",
    "CodeRows": "coding",
    "omp_rows": "coding",
    "omp_rows_gram": "coding",
    "SAMPLE_IMAGES": "image_patches",
    "sample_image_patches": "image_patches",
}

__all__ = sorted(_PUBLIC)
__getattr__ = lazy_exports(__name__, _PUBLIC)
