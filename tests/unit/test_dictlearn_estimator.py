"""``DictionaryLearning`` in one process: scikit-learn's own estimator checks, codes equal to scikit-learn's
``sparse_encode``, ``partial_fit`` over a stream, and refusals of what cannot be learned."""

import re

import numpy as np
import pytest
from sklearn.decomposition import sparse_encode
from sklearn.linear_model import orthogonal_mp_gram
from sklearn.utils.estimator_checks import parametrize_with_checks

from mpiscale.dictlearn import DictionaryLearning, omp_encode, omp_rows
from mpiscale.dictlearn.synthetic import planted_dictionary, recovery_rate

# Every check applies. scikit-learn itself skips check_array_api_input (its array-API checks need SCIPY_ARRAY_API
# set, and the estimator computes in numpy float64 whatever arrays come in).


@parametrize_with_checks([DictionaryLearning(n_iter=50)])
def test_scikit_learn_estimator_checks(estimator, check):
    check(estimator)


def planted(samples=1200, atoms=30, features=16, nonzeros=3, seed=0):
    rng = np.random.default_rng(seed)
    dictionary = planted_dictionary(atoms, features, seed + 1)
    codes = np.zeros((samples, atoms))
    for row in codes:
        row[rng.choice(atoms, nonzeros, replace=False)] = rng.standard_normal(nonzeros)
    return dictionary, codes @ dictionary


def test_omp_codes_equal_scikit_learns():
    dictionary, signals = planted()
    estimator = DictionaryLearning(30, n_iter=20, transform_n_nonzero_coefs=5).fit(signals)
    noisy = signals + 0.1 * np.random.default_rng(1).standard_normal(signals.shape)
    theirs = sparse_encode(noisy, estimator.components_, algorithm="omp", n_nonzero_coefs=5)
    assert np.abs(estimator.transform(noisy) - theirs).max() < 1e-10


def test_omp_to_an_error_target_equals_scikit_learns():
    """OMP until ||x - cD|| <= epsilon (K-SVD denoising, SPAMS's eps) against scikit-learn's ``orthogonal_mp_gram``
    with ``tol`` (the squared norm; its ``sparse_encode`` offers no error target). A signal already within epsilon
    takes no atom; scikit-learn takes one before it looks at the error, so those are compared apart."""
    dictionary, signals = planted()
    estimator = DictionaryLearning(30, n_iter=20, transform_max_residual=1.5, transform_n_nonzero_coefs=16)
    estimator.fit(signals)
    noisy = signals + 0.3 * np.random.default_rng(3).standard_normal(signals.shape)
    ours = estimator.transform(noisy)
    atoms = estimator.components_
    theirs = orthogonal_mp_gram(atoms @ atoms.T, atoms @ noisy.T, tol=1.5**2, norms_squared=(noisy**2).sum(1)).T
    small = np.linalg.norm(noisy, axis=1) <= 1.5
    assert small.any() and not ours[small].any()
    assert np.abs(ours[~small] - theirs[~small]).max() < 1e-10
    residuals = np.linalg.norm(noisy - ours @ atoms, axis=1)
    used = np.count_nonzero(ours, axis=1)
    assert (residuals <= 1.5 + 1e-9).all() and len(set(used)) > 3  # each signal as many atoms as it needs


def test_lasso_codes_equal_scikit_learns_where_both_converge():
    """Orthonormal atoms: scikit-learn's coordinate descent reaches the exact minimiser (soft thresholding), where our
    path ends; on coherent atoms it stops at its own tolerance (tests/unit/test_dictlearn_parts.py compares
    objectives there)."""
    rng = np.random.default_rng(2)
    atoms = np.linalg.qr(rng.standard_normal((16, 16)))[0][:10]
    estimator = DictionaryLearning(10, n_iter=5, transform_algorithm="lasso_cd", transform_alpha=0.2)
    estimator.fit(rng.standard_normal((100, 16)))
    estimator.components_ = atoms  # the atoms under test, as a user would set a known dictionary
    signals = rng.standard_normal((300, 16))
    theirs = sparse_encode(signals, atoms, algorithm="lasso_cd", alpha=0.2)
    assert np.abs(estimator.transform(signals) - theirs).max() < 1e-10
    assert np.count_nonzero(theirs) < theirs.size  # the penalty zeroes some codes


def test_partial_fit_over_a_stream_recovers_the_planted_atoms():
    dictionary, signals = planted(samples=24_000)
    estimator = DictionaryLearning(30, random_state=4)
    for batch in np.array_split(signals, 120):
        estimator.partial_fit(batch)
    assert estimator.n_iter_ == 120 and estimator.components_.shape == (30, 16)
    assert recovery_rate(dictionary, estimator.components_) >= 0.9
    rebuilt = estimator.inverse_transform(estimator.transform(signals[:1000]))
    assert np.linalg.norm(rebuilt - signals[:1000]) < 0.2 * np.linalg.norm(signals[:1000])


@pytest.mark.parametrize("method", ["online", "mod"])
def test_the_same_dictionary_is_learned_at_any_scale_of_the_data(method):
    """Data in small units (1e-12, 1e-100) learns what the same data at 1 does: fixed floors on OMP's correlations and
    on an atom's weight once left every atom where it started at 1e-12, and coded 1e-16 data as zeros."""
    _, signals = planted(samples=2000)
    reference = DictionaryLearning(20, method=method, n_iter=30, random_state=1).fit(signals)
    for scale in (1e-12, 1e-100):
        scaled = DictionaryLearning(20, method=method, n_iter=30, random_state=1).fit(signals * scale)
        assert np.allclose(scaled.components_, reference.components_, atol=1e-9), scale
        assert scaled.error_ == pytest.approx(reference.error_, rel=1e-9)
        codes = scaled.transform(signals[:100] * scale) / scale
        assert np.allclose(codes, reference.transform(signals[:100]), atol=1e-9)


@pytest.mark.parametrize("method", ["online", "mod"])
def test_max_iter_counts_passes_over_the_data_as_scikit_learn_does(method):
    """scikit-learn's ``max_iter`` (epochs) was an unknown keyword; it runs that many passes of mini-batches (of
    whole-data iterations with mod), the very iterations ``n_iter`` names one by one."""
    _, signals = planted(samples=300)
    per_pass = 300 // 50 if method == "online" else 1
    by_passes = DictionaryLearning(8, method=method, batch_size=50, max_iter=3, n_iter=1).fit(signals)
    by_steps = DictionaryLearning(8, method=method, batch_size=50, n_iter=3 * per_pass).fit(signals)
    assert by_passes.n_iter_ == 3 * per_pass
    np.testing.assert_array_equal(by_passes.components_, by_steps.components_)
    with pytest.raises(ValueError, match="max_iter must be None or an integer of at least 1, got 0"):
        DictionaryLearning(8, max_iter=0).fit(signals)


def test_what_cannot_be_learned_is_refused_with_the_parameter_named():
    _, signals = planted(samples=300)
    with pytest.raises(ValueError, match="every value is zero"):
        DictionaryLearning(10).fit(np.zeros((50, 8)))
    with pytest.raises(ValueError, match="underflow"):
        DictionaryLearning(10).fit(signals * 1e-160)
    with pytest.raises(ValueError, match=r"n_components must be an integer of at least 1, got 0.*"
                                         r"fit_algorithm must be one of omp, lasso, got 'lars'"):  # fmt: skip
        DictionaryLearning(0, fit_algorithm="lars").fit(signals)
    with pytest.raises(ValueError, match="partial_fit takes online steps"):
        DictionaryLearning(10, method="mod").partial_fit(signals)
    fitted = DictionaryLearning(10, n_iter=5).fit(signals)
    with pytest.raises(ValueError, match="codes have one column per atom: 10, got 16"):
        fitted.inverse_transform(signals)
    with pytest.raises(ValueError, match="16 features"):
        fitted.transform(signals[:, :8])
    table = np.rec.fromarrays([signals[:, 0].astype(np.float32), signals[:, 1]], names="depth,t")
    for call in (DictionaryLearning(10).fit, fitted.transform):  # (scikit-learn said "Cannot cast array data")
        with pytest.raises(ValueError, match=re.escape(
            "got a table (records of the fields depth (float32), t (float64)), not one array of numbers: store its "
            "number fields as one array, e.g. numpy.lib.recfunctions.structured_to_unstructured(table)"
        )):  # fmt: skip
            call(table)


def test_sparse_rows_of_codes_to_an_error_target_rebuild_the_dense_codes():
    """Codes to an error target fill fewer slots than the most allowed; the slots past a row's count hold what the
    kernel's buffers held (large garbage indices made ``rebuilt`` fail in ``mpiscale encode``)."""
    dictionary, signals = planted(samples=300)
    rows = omp_rows(signals + 0.05, dictionary, 16, max_residual=0.5)
    rows.atoms[rows.counts < 16, -1] = 2**40  # what an empty buffer may hold
    codes = rows.dense()
    assert (
        len(set(rows.counts)) > 1
        and np.abs(codes - omp_encode(signals + 0.05, dictionary, 16, max_residual=0.5)).max() == 0
    )
    assert np.abs(rows.rebuilt(dictionary) - codes @ dictionary).max() < 1e-12
    values, indices, starts = rows.csr()
    assert np.array_equal(starts[1:], np.cumsum(rows.counts)) and (indices < 30).all() and len(values) == starts[-1]
