"""Batch-OMP kernel against scikit-learn's orthogonal_mp_gram, exact recovery, and bad input."""

import numba
import numpy as np
import pytest
from sklearn.linear_model import orthogonal_mp_gram

from mpiscale.dictlearn import omp_encode, omp_encode_gram
from mpiscale.dictlearn.coding import correlations_of, gram_matrix
from mpiscale.kernels.omp import _most_correlated, chunk_rows


def dictionary(atoms: int, features: int, seed: int = 0) -> np.ndarray:
    atoms_rows = np.random.default_rng(seed).standard_normal((atoms, features))
    return atoms_rows / np.linalg.norm(atoms_rows, axis=1, keepdims=True)


@pytest.mark.parametrize(("atoms", "features", "nonzero"), [(50, 20, 3), (256, 64, 8), (30, 30, 30), (12, 40, 1)])
def test_same_codes_as_scikit_learn(atoms, features, nonzero):
    d = dictionary(atoms, features)
    signals = np.random.default_rng(1).standard_normal((700, features))  # several chunks, one partial
    ours = omp_encode(signals, d, nonzero)
    reference = orthogonal_mp_gram(d @ d.T, (signals @ d.T).T, n_nonzero_coefs=nonzero).T
    assert np.allclose(ours, reference, atol=1e-9, rtol=1e-9)
    assert (np.count_nonzero(ours, axis=1) <= nonzero).all()


@pytest.mark.parametrize("atoms", [1, 3, 4, 5, 9, 256])
def test_the_next_atom_is_the_first_of_largest_magnitude(atoms):
    """The kernel's choice of the next atom (four running maxima) is numpy's argmax of |alpha|: ties to the lowest
    index, whichever position modulo 4 it holds; -1 when every correlation is 0."""
    rng = np.random.default_rng(atoms)
    cases = [rng.standard_normal(atoms), np.zeros(atoms), np.ones(atoms), -np.ones(atoms)]
    for place in range(atoms):  # the largest tied at each place and at the last one, in every lane
        tied = rng.uniform(-1, 1, atoms)
        tied[place], tied[-1] = 2.0, -2.0
        cases.append(tied)
    for alpha in cases:
        expected = int(np.argmax(np.abs(alpha))) if np.abs(alpha).max() > 0 else -1
        assert _most_correlated(alpha) == expected, alpha


def test_the_gram_matrix_is_the_product_for_every_shape_and_dtype():
    """BLAS's symmetric product mirrored by the kernel: the values of ``D @ D.T`` (to rounding: the two products
    may add in other orders), exactly symmetric, C-contiguous, of the dictionary's dtype; a dictionary without atoms
    or features, or of integers, takes the general product."""
    for shape in [(256, 64), (70, 9), (1, 1), (3, 0), (0, 3)]:
        for dtype, tolerance in ((np.float64, 1e-12), (np.float32, 1e-5), (np.int64, 0)):
            d = (np.random.default_rng(0).standard_normal(shape) * 4).astype(dtype)
            gram, product = gram_matrix(d), d @ np.ascontiguousarray(d.T)
            assert gram.dtype == dtype and gram.flags.c_contiguous and np.array_equal(gram, gram.T)
            assert np.allclose(gram, product, rtol=tolerance, atol=tolerance * max(1, shape[1]) * 16)


@pytest.mark.parametrize(("count", "threads", "rows"), [(256, 16, 16), (256, 2, 128), (10_000, 16, 128), (3, 16, 1)])
def test_every_thread_gets_a_chunk(count, threads, rows):
    assert chunk_rows(count, threads) == rows


@pytest.mark.parametrize("count", [1, 3, 129, 700])
def test_the_same_codes_on_any_number_of_threads(count):
    d = dictionary(64, 16)
    signals = np.random.default_rng(6).standard_normal((count, 16))
    before = numba.get_num_threads()
    by_threads = []  # (from the signals, from the correlations): a row's products in the two may round differently
    try:
        for threads in sorted({1, numba.config.NUMBA_NUM_THREADS}):
            numba.set_num_threads(threads)
            by_threads.append(
                (omp_encode(signals, d, 5), omp_encode_gram(gram_matrix(d), correlations_of(signals, d), 5))
            )
    finally:
        numba.set_num_threads(before)
    for codes in zip(*by_threads):
        assert all(np.array_equal(codes[0], other) for other in codes[1:])
        assert (np.count_nonzero(codes[0], axis=1) > 0).all()  # every signal coded, none left out of a chunk


def test_unnormalised_atoms_are_coded_as_scikit_learn_codes_their_unit_atoms():
    """scikit-learn assumes unit atoms (and picks long ones first when they are not); ours picks as on the unit
    atoms, and weighs the atoms as given."""
    norms = np.linspace(0.5, 3.0, 40)
    unit = dictionary(40, 16)
    d = unit * norms[:, None]
    signals = np.random.default_rng(2).standard_normal((300, 16))
    reference = orthogonal_mp_gram(unit @ unit.T, (signals @ unit.T).T, n_nonzero_coefs=5).T / norms
    assert np.allclose(omp_encode(signals, d, 5), reference, atol=1e-9)


def test_exact_recovery_with_orthonormal_atoms():
    basis = np.linalg.qr(np.random.default_rng(3).standard_normal((32, 32)))[0].T  # 32 orthonormal atoms
    codes = np.zeros((200, 32))
    rng = np.random.default_rng(4)
    for row in codes:
        row[rng.choice(32, 4, replace=False)] = rng.uniform(1, 2, 4) * rng.choice([-1, 1], 4)
    assert np.allclose(omp_encode(codes @ basis, basis, 4), codes, atol=1e-12)


@pytest.mark.parametrize("scale", [1e-16, 1e-100, 1e100])
def test_codes_scale_with_the_signals(scale):
    """OMP picks the same atoms at any scale, the coefficients scaled: a fixed floor on the residual's correlations
    once coded every signal of 1e-16 data as zeros, without a word."""
    d = dictionary(40, 16)
    signals = np.random.default_rng(5).standard_normal((100, 16))
    codes = omp_encode(signals, d, 5)
    assert np.allclose(omp_encode(signals * scale, d, 5) / scale, codes, rtol=1e-9, atol=1e-12)


def test_zero_signal_and_dependent_atoms_stop_early():
    d = dictionary(6, 3)
    codes = omp_encode(np.zeros((2, 3)), d, 3)
    assert not codes.any()
    duplicated = np.vstack([d[:2], d[:2]])  # atoms 2, 3 repeat 0, 1: a 3rd atom is never independent
    x = d[:1] + 2 * d[1:2]
    codes = omp_encode(x, duplicated, 4)
    assert np.count_nonzero(codes) == 2 and np.allclose(codes @ duplicated, x)


def test_an_error_target_past_float64s_squares_codes_nothing():
    """A target of 1e300 (every residual is within it) ended in an OverflowError squaring it; it codes nothing, as
    any target above the signals' norms does."""
    d, x = dictionary(8, 5), np.random.default_rng(6).standard_normal((10, 5))
    for target in (1e300, 1e154, 1e3):
        assert not omp_encode(x, d, 3, max_residual=target).any(), target
    assert omp_encode(x, d, 3, max_residual=1e-3).any()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda d, x: omp_encode(x, d, 0), "between 1 and the number of atoms"),
        (lambda d, x: omp_encode(x, d, 9), "between 1 and the number of atoms"),
        (lambda d, x: omp_encode(np.where(x > 1, np.nan, x), d, 2), "signals holds .* NaN"),
        (lambda d, x: omp_encode(x[:, :3], d, 2), "disagree"),
        (lambda d, x: omp_encode(x, np.vstack([d[:7], np.zeros(5)]), 2), r"atoms \[7\] are zero"),
        (lambda d, x: omp_encode_gram(d @ d.T, x, 2), r"correlations must be \(signals, 8\)"),
    ],
)
def test_bad_input(call, message):
    d, x = dictionary(8, 5), np.random.default_rng(5).standard_normal((10, 5)) * 3
    with pytest.raises(ValueError, match=message):
        call(d, x)


@pytest.mark.parametrize("path", ["signals", "gram", "error target"])
def test_an_atoms_scale_changes_its_weight_never_the_atoms_chosen(path):
    """Atoms of other norms (NMF's components, a user's exemplars) are picked as unit atoms would be: OMP by the raw
    correlation picked long atoms first, and most signals' supports differed from the unit atoms'."""
    rng = np.random.default_rng(0)
    unit = rng.standard_normal((30, 10))
    unit /= np.linalg.norm(unit, axis=1, keepdims=True)
    signals = rng.standard_normal((200, 10))
    scales = rng.uniform(0.1, 10, 30)
    scaled = unit * scales[:, None]
    if path == "gram":
        codes = omp_encode_gram(gram_matrix(scaled), correlations_of(signals, scaled), 3)
        expected = omp_encode_gram(gram_matrix(unit), correlations_of(signals, unit), 3)
    else:
        target = 0.5 if path == "error target" else None
        codes, expected = (omp_encode(signals, atoms, 5, max_residual=target) for atoms in (scaled, unit))
    np.testing.assert_array_equal(codes != 0, expected != 0)
    np.testing.assert_allclose(codes * scales, expected, atol=1e-12)
