"""Numba kernels, one module per family."""
