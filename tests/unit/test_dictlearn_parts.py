"""Dictionary-learning parts in one process: Lasso coder, updates, statistics, replacement, settings."""

import math

import numpy as np
import pytest
from sklearn.decomposition import sparse_encode

from mpiscale.dictlearn import lasso_encode
from mpiscale.dictlearn.coding import rows_of_dense
from mpiscale.dictlearn.config import DictLearnConfig, load_config
from mpiscale.dictlearn.history import METRICS, History
from mpiscale.dictlearn.synthetic import planted_dictionary, planted_signals, recovery_rate
from mpiscale.dictlearn.update import (
    BatchStatistics,
    DictionaryState,
    atoms_to_replace,
    forgetting_factor,
    mod_update,
    replace_atoms,
)
from mpiscale.kernels.code_statistics import fold_packed
from mpiscale.kernels.dict_update import block_coordinate_update
from mpiscale.kernels.lasso import lasso_gram


def test_lasso_matches_scikit_learn():
    d = planted_dictionary(50, 20, 1)
    x = np.random.default_rng(2).standard_normal((300, 20))
    ours = lasso_encode(x, d, 0.3, max_sweeps=10_000, tol=1e-12)
    theirs = sparse_encode(x, d, algorithm="lasso_cd", alpha=0.3, max_iter=100_000)

    def objective(codes):
        return 0.5 * ((x - codes @ d) ** 2).sum() + 0.3 * np.abs(codes).sum()

    assert objective(ours) <= objective(theirs) * (1 + 1e-9)
    assert np.abs(ours - theirs).max() < 2e-3  # scikit-learn stops at its own tolerance
    assert 1 < np.count_nonzero(ours) / len(x) < 50


def random_walk_atoms(atoms: int, features: int, seed: int) -> np.ndarray:
    """Unit atoms that are random walks less their means: they overlap (cosines up to 0.98 here) as learned ones
    do, unlike independent random atoms."""
    walks = np.cumsum(np.random.default_rng(seed).standard_normal((atoms, features)), axis=1)
    walks -= walks.mean(axis=1, keepdims=True)
    return walks / np.linalg.norm(walks, axis=1, keepdims=True)


def optimality_gap(x, d, codes, alpha):
    """How far ``codes`` are from the Lasso minimiser's conditions, relative to alpha: the correlation of each used
    atom with the residual must be alpha times its weight's sign, of every other atom at most alpha."""
    correlations = (x - codes @ d) @ d.T
    used = codes != 0
    on_used = np.abs(correlations - alpha * np.sign(codes))[used]
    past_alpha = np.abs(correlations[~used]) - alpha
    return max(on_used.max(initial=0.0), past_alpha.max(initial=0.0)) / alpha


@pytest.mark.parametrize("alpha", [0.5, 0.05, 0.005])
def test_lasso_path_ends_at_the_minimiser_on_overlapping_atoms(alpha):
    d = random_walk_atoms(96, 24, 3)
    x = np.random.default_rng(4).standard_normal((100, 24))
    codes = np.empty((100, 96))
    assert lasso_gram(d @ d.T, x @ d.T, alpha, 1, 0.0, codes) == 0  # no signal left to descent (1 sweep: useless)
    assert optimality_gap(x, d, codes, alpha) < 1e-8

    theirs = sparse_encode(x, d, algorithm="lasso_lars", alpha=alpha)  # the same path, scikit-learn's

    def objective(c):
        return 0.5 * ((x - c @ d) ** 2).sum(axis=1) + alpha * np.abs(c).sum(axis=1)

    assert (objective(codes) <= objective(theirs) * (1 + 1e-12)).all()
    assert 2 < np.count_nonzero(codes) / len(x) < 24


def test_lasso_codes_by_descent_where_the_path_meets_dependent_atoms():
    d = planted_dictionary(6, 8, 5)
    both = d[0] + d[1]
    d = np.vstack([d, both / np.linalg.norm(both)])  # an atom in the span of two others
    rng = np.random.default_rng(7)
    x = np.vstack([3 * both + 0.01 * rng.standard_normal((50, 8)), rng.standard_normal((50, 8))])
    codes = np.empty((100, 7))
    descended = lasso_gram(d @ d.T, x @ d.T, 1e-3, 100_000, 1e-12, codes)
    assert 0 < descended < 100
    assert optimality_gap(x, d, codes, 1e-3) < 1e-6
    assert np.abs(lasso_encode(x, d, 1e-3, max_sweeps=100_000, tol=1e-12) - codes).max() < 1e-12


def test_lasso_refuses_a_bad_penalty():
    d = planted_dictionary(5, 4, 0)
    with pytest.raises(ValueError, match="alpha must be a positive number"):
        lasso_encode(np.ones((2, 4)), d, 0.0)


def exact_problem(atoms=30, features=16, signals=400, nonzeros=3):
    """Sparse codes and signals they make exactly: the planted dictionary is the one minimiser."""
    planted = planted_dictionary(atoms, features, 5)
    rng = np.random.default_rng(6)
    codes = np.zeros((signals, atoms))
    for row in codes:
        row[rng.choice(atoms, nonzeros, replace=False)] = rng.standard_normal(nonzeros)
    return planted, codes @ planted, codes


def test_block_coordinate_update_keeps_the_minimiser_and_returns_to_it():
    planted, x, codes = exact_problem()
    a, b = codes.T @ codes, codes.T @ x
    fixed = planted.copy()
    block_coordinate_update(fixed, a, b, 1e-12)
    assert np.allclose(fixed, planted, atol=1e-12)
    moved = planted + 0.05 * np.random.default_rng(0).standard_normal(planted.shape)
    moved /= np.linalg.norm(moved, axis=1, keepdims=True)
    for _ in range(200):
        block_coordinate_update(moved, a, b, 1e-12)
    assert np.abs(moved - planted).max() < 1e-6


def sweep_atom_by_atom(dictionary, a, b, min_weight):
    """The sweep as Mairal et al. write it: each atom in turn, from the atoms before it as already moved."""
    for j in range(len(dictionary)):
        if a[j, j] > min_weight:
            value = dictionary[j] + (b[j] - a[j] @ dictionary) / a[j, j]
            dictionary[j] = value / np.linalg.norm(value)


@pytest.mark.parametrize(("atoms", "features"), [(100, 7), (32, 5), (33, 40), (2, 3)])
def test_the_blocked_sweep_is_the_atom_by_atom_one(atoms, features):
    rng = np.random.default_rng(atoms)
    codes = rng.standard_normal((5 * atoms, atoms)) * (rng.random((5 * atoms, atoms)) < 0.2)
    codes[:, ::9] = 0.0  # atoms no signal used: weight 0, left as they are
    signals = rng.standard_normal((len(codes), features))
    a, b = codes.T @ codes, codes.T @ signals
    start = rng.standard_normal((atoms, features))
    start /= np.linalg.norm(start, axis=1, keepdims=True)
    ours, reference = start.copy(), start.copy()
    for _ in range(3):
        block_coordinate_update(ours, a, b, 1e-12)
        sweep_atom_by_atom(reference, a, b, 1e-12)
    assert np.allclose(ours, reference, rtol=0, atol=1e-12)
    assert np.array_equal(ours[::9], start[::9]) and not np.allclose(ours, start)


def test_mod_update_solves_for_the_dictionary():
    planted, x, codes = exact_problem()
    stats = BatchStatistics(30, 16, 1, 2)
    stats.fill(0, np.arange(len(x)), x, rows_of_dense(codes, 30), planted, 0.0)
    stats.unpack()
    state = DictionaryState.start(np.eye(30, 16))
    mod_update(state, stats)
    assert np.abs(state.dictionary - planted).max() < 1e-8


def test_forgetting_factor():
    assert forgetting_factor(0, 10.0) == 0.0
    assert forgetting_factor(9, 1.0) == pytest.approx(0.9)
    assert forgetting_factor(99, 10.0) == pytest.approx(0.99**10)


def test_statistics_and_worst_signals_do_not_depend_on_the_split():
    planted, x, _ = exact_problem()
    codes = np.random.default_rng(3).standard_normal((len(x), 30)) * (
        np.random.default_rng(4).random((len(x), 30)) < 0.1
    )
    ids = np.arange(len(x))
    whole = BatchStatistics(30, 16, 1, 4)
    whole.fill(0, ids, x, rows_of_dense(codes, 30), planted, 0.0)
    whole.unpack()
    assert np.allclose(whole.a, codes.T @ codes) and np.allclose(whole.b, codes.T @ x)  # the sparse kernel
    assert (whole.usage == np.count_nonzero(codes, axis=0)).all()
    parts = [BatchStatistics(30, 16, 3, 4) for _ in range(3)]
    for rank, chunk in enumerate(np.array_split(ids, 3)):
        parts[rank].fill(rank, chunk, x[chunk], rows_of_dense(codes[chunk], 30), planted, 0.0)
    summed = BatchStatistics(30, 16, 3, 4)
    summed.buffer[:] = sum(p.buffer for p in parts)
    summed.unpack()
    assert (summed.a == summed.a.T).all()
    assert np.allclose(summed.a, whole.a) and np.allclose(summed.b, whole.b)
    assert (summed.usage == whole.usage).all() and summed.sum("signals") == len(x)
    assert np.allclose(summed.worst_signals()[:4], whole.worst_signals())  # the union of every rank's 4 worst
    residual = ((x - codes @ planted) ** 2).sum(axis=1)
    worst = np.argsort(-residual)[:4]
    assert np.allclose(whole.worst_signals(), (x - codes @ planted)[worst])


@pytest.mark.parametrize("atoms", [1, 7, 8, 9, 17, 70])
def test_folding_the_packed_sum_into_the_statistics_is_exact_and_symmetric(atoms):
    """The decayed ``a`` (tiled mirror of the upper triangle) is, value for value, beta a + A / count."""
    rng = np.random.default_rng(atoms)
    packed = rng.standard_normal(atoms * (atoms + 1) // 2)
    full = np.zeros((atoms, atoms))
    full[np.triu_indices(atoms)] = packed
    full = np.triu(full) + np.triu(full, 1).T
    old = rng.standard_normal((atoms, atoms))
    old = old + old.T
    folded = old.copy()
    fold_packed(folded, packed, 0.9, 7.0)
    assert np.array_equal(folded, 0.9 * old + full / 7.0) and np.array_equal(folded, folded.T)
    unpacked = np.full((atoms, atoms), np.nan)  # beta 0 reads nothing of the old values
    fold_packed(unpacked, packed, 0.0, 1.0)
    assert np.array_equal(unpacked, full)


def test_statistics_of_code_rows_skip_zero_weights_as_dense_codes_do():
    """A coder's rows may hold a weight of exactly zero (a signal of zeros, or an atom solved to 0): that is no use of
    the atom, as in the dense codes, and the L1 sum (Lasso's objective) is the dense codes' one."""
    planted, x, _ = exact_problem()
    rng = np.random.default_rng(6)
    codes = rng.standard_normal((len(x), 30)) * (rng.random((len(x), 30)) < 0.1)
    rows = rows_of_dense(codes, 30)
    rows.values[0, : rows.counts[0]] = 0.0  # a first signal coded by zero weights
    codes[0] = 0.0
    stats = BatchStatistics(30, 16, 1, 4)
    stats.fill(0, np.arange(len(x)), x, rows, planted, 0.5)
    stats.unpack()
    assert (stats.usage == np.count_nonzero(codes, axis=0)).all()
    assert np.allclose(stats.a, codes.T @ codes, rtol=0, atol=1e-12) and np.allclose(stats.b, codes.T @ x)
    assert stats.sum("l1") == pytest.approx(np.abs(codes).sum(), rel=1e-14)


def test_idle_and_duplicate_atoms_are_replaced_by_the_worst_residuals():
    dictionary = planted_dictionary(6, 5, 0)
    dictionary[4] = dictionary[1]  # a duplicate
    state = DictionaryState.start(dictionary)
    state.a[np.diag_indices(6)] = [1, 5, 1, 1, 2, 1]
    usage = np.array([3, 3, 0, 3, 3, 3])
    gram = state.dictionary @ state.dictionary.T
    assert atoms_to_replace(state, usage, 2, 0.99, gram) == [4]  # atom 2 idle once only; atom 4 the less used twin
    assert atoms_to_replace(state, usage, 2, 0.99, gram) == [2, 4]
    residuals = np.random.default_rng(1).standard_normal((1, 5))
    assert replace_atoms(state, [2, 4], residuals) == 1  # one candidate signal, one replacement
    assert np.allclose(state.dictionary[2], residuals[0] / np.linalg.norm(residuals[0]))
    assert state.a[2].sum() == 0 and state.idle[2] == 0


def test_a_ratio_past_float64s_range_plants_signals_without_noise():
    """--snr-db 1e6 ended the job in an OverflowError (10**(dB/10) past float64); it is no noise, as inf is."""
    dictionary = planted_dictionary(12, 8, 0)
    ids = np.arange(50)
    clean = planted_signals(dictionary, ids, 3, math.inf, 0)
    np.testing.assert_array_equal(planted_signals(dictionary, ids, 3, 1e6, 0), clean)
    assert not np.array_equal(planted_signals(dictionary, ids, 3, 20.0, 0), clean)


def test_recovery_rate():
    planted = planted_dictionary(10, 8, 0)
    assert recovery_rate(planted, -planted[::-1]) == 1.0
    assert recovery_rate(planted, planted[:5]) == 0.5


def test_config_from_toml_with_overrides(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[dictlearn]\natoms = 64\nsparsity = 4\ndata = "x.h5:/signals"\n')
    config = load_config(str(path), {"sparsity": 5, "iterations": None})
    assert (config.atoms, config.sparsity, config.iterations) == (64, 5, DictLearnConfig().iterations)
    assert config.data_path == ("x.h5", "signals")
    path.write_text("atom = 3\n")
    with pytest.raises(ValueError, match=r"unknown settings \['atom'\]"):
        load_config(str(path), {})
    path.write_text('atoms = "many"\n')
    with pytest.raises(ValueError, match="atoms must be int"):
        load_config(str(path), {})
    # a setting outside the command's table was read by nothing, without a word (tables of other commands are theirs)
    path.write_text("atoms = 64\n[dictlearn]\nsparsity = 4\n[encode]\nbatch_size = 9\n")
    with pytest.raises(ValueError, match=r"job.toml: atoms outside its \[dictlearn\] table, where dictlearn reads its "
                                         "settings: move it into the table"):  # fmt: skip
        load_config(str(path), {})
    path.write_text("[dictlearn]\nsparsity = 4\n[encode]\nbatch_size = 9\n")
    assert load_config(str(path), {}).sparsity == 4
    path.write_bytes("\ufeff[dictlearn]\r\nsparsity = 6\r\n".encode())  # as Notepad saves it: "Invalid statement"
    assert load_config(str(path), {}).sparsity == 6


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"sparsity": 9, "atoms": 8}, "sparsity 9 exceeds the number of atoms 8"),
        ({"method": "ksvd"}, "method must be one of"),
        ({"target_error": 0.1}, "target_error needs eval_every"),
        ({"batch_size": 0}, "batch_size must be at least 1"),
        ({"target_error": math.nan, "eval_every": 1}, "target_error must be a number >= 0 .0: none., got nan"),
        ({"target_error": -0.5, "eval_every": 1}, "target_error must be a number >= 0"),
        ({"snr_db": math.nan}, "synthetic: snr_db must be a number of dB >= -100 .inf: no noise., got nan"),
        ({"snr_db": -1e6}, "synthetic: snr_db must be a number of dB >= -100"),
        ({"device": "gpu"}, "device must be one of auto, cpu, cuda, got 'gpu'"),  # said as the GPU's choice failing
        ({"device": "cuda:1"}, "device must be one of auto, cpu, cuda, got 'cuda:1'"),
    ],
)
def test_config_errors(values, message):
    """Settings that make no sense are refused; NaN was taken as no noise, or as a target never reached."""
    with pytest.raises(ValueError, match=message):
        DictLearnConfig(**values)


def test_history_rows_combine_iterations_and_survive_a_checkpoint():
    history = History.start(2500, 2)  # about 1,000 rows: 3 iterations per row
    assert history.every == 3
    for iteration in range(7):
        values = dict.fromkeys(METRICS, float(iteration)) | {"full_error": 0.5 if iteration == 1 else math.nan}
        history.record(values, np.array([iteration, 1]))
    assert np.array_equal(np.array(history.usage), [[0 + 1 + 2, 3], [3 + 4 + 5, 3], [6, 1]])
    assert history.metrics["objective"] == [1.0, 4.0, 6.0]  # means
    assert history.metrics["comm_s"] == [3.0, 12.0, 6.0]  # sums
    assert history.metrics["time_s"] == [2.0, 5.0, 6.0]  # last values
    assert history.metrics["full_error"][0] == 0.5 and math.isnan(history.metrics["full_error"][1])
    assert list(history.row_ends()) == [3, 6, 7]
    again = History.start(10, 2)
    again.from_arrays(history.to_arrays())
    again.record(dict.fromkeys(METRICS, 7.0), np.array([7, 1]))
    assert again.iterations == 8 and np.array_equal(again.usage[-1], [6 + 7, 2])
    assert again.metrics["objective"][-1] == 6.5
