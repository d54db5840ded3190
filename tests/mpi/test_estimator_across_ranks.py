"""``DictionaryLearning`` learns what ``mpiscale dictlearn`` learns: the same data (written by a user with h5py), the
same settings and the same number of ranks give the same dictionary, in one process, under mpirun, and inside
``mpiscale.run``; a problem on one rank is refused on every rank; a job's results file becomes a fitted estimator."""

import json
import sys

import h5py
import numpy as np
import pytest
from helpers import assert_ok, finish, launch, run_mpi

from mpiscale.dictlearn import DictionaryLearning, load_results
from mpiscale.dictlearn.synthetic import planted_dictionary

SETTINGS = {"n_components": 24, "n_nonzero_coefs": 3, "batch_size": 64, "n_iter": 60, "random_state": 3}
JOB_OPTIONS = ["--atoms", "24", "--sparsity", "3", "--batch-size", "64", "--iterations", "60", "--seed", "3"]


@pytest.fixture(scope="module")
def signals(tmp_path_factory):
    """1,003 noisy signals of 16 features (an odd count: the ranks' blocks differ), float32 as users store them."""
    path = tmp_path_factory.mktemp("data") / "signals.h5"
    rng = np.random.default_rng(11)
    atoms = planted_dictionary(24, 16, 4)
    codes = np.zeros((1003, 24))
    for row in codes:
        row[rng.choice(24, 3, replace=False)] = rng.standard_normal(3)
    with h5py.File(path, "w") as file:
        file["signals"] = (codes @ atoms + 0.01 * rng.standard_normal((1003, 16))).astype(np.float32)
    return path


def job_dictionary(ranks: int, data, out, *options: str) -> np.ndarray:
    command = [sys.executable, "-m", "mpiscale.cli", "dictlearn", "--data", f"{data}:/signals", "--out", str(out),
               "--progress-every", "0", *JOB_OPTIONS, *options]  # fmt: skip
    assert_ok(finish(launch(ranks, command), f"dictlearn {' '.join(options)} on {ranks} ranks", 120))
    return load_results(str(out)).dictionary


def estimator_dictionary(ranks: int, data, out, mode: str = "plain", **settings) -> np.ndarray:
    job = run_mpi("estimator_fit.py", ranks, str(data), str(out), json.dumps(SETTINGS | settings), mode, timeout=120)
    assert_ok(job)
    assert f"fitted on {ranks} ranks" in job.stdout, job.output[-3000:]
    return np.load(out)


def test_the_estimator_learns_the_jobs_dictionary_on_as_many_ranks(signals, tmp_path, ranks):
    job = job_dictionary(ranks, signals, tmp_path / "job.h5")
    ours = estimator_dictionary(ranks, signals, tmp_path / "estimator.npy")
    assert np.abs(ours - job).max() < 1e-12, np.abs(ours - job).max()


def test_in_one_process_and_inside_the_runtime_with_other_coders_mean_removal_and_mod(signals, tmp_path):
    job = job_dictionary(1, signals, tmp_path / "job.h5")
    with h5py.File(signals, "r") as file:
        alone = DictionaryLearning(**SETTINGS).fit(file["signals"][()])
    assert np.abs(alone.components_ - job).max() < 1e-12
    lasso = job_dictionary(2, signals, tmp_path / "lasso.h5", "--coder", "lasso", "--alpha", "0.05")
    ours = estimator_dictionary(2, signals, tmp_path / "lasso.npy", "runtime", fit_algorithm="lasso", alpha=0.05)
    # (exact Lasso codes move with their inputs' rounding times the inverse of the used atoms' Gram matrix: 4e-12
    # here after 300 steps, where the descent's codes, stopped at its tolerance, hid it)
    assert np.abs(ours - lasso).max() < 1e-10
    target = job_dictionary(2, signals, tmp_path / "target.h5", "--max-residual", "0.05", "--remove-mean")
    ours = estimator_dictionary(2, signals, tmp_path / "target.npy", max_residual=0.05, remove_mean=True)
    assert np.abs(ours - target).max() < 1e-12 and np.abs(target - lasso).max() > 0.1
    assert np.abs(target.mean(axis=1)).max() < 1e-9  # atoms of mean-free signals have no mean themselves
    mod = job_dictionary(2, signals, tmp_path / "mod.h5", "--method", "mod", "--iterations", "8")
    ours = estimator_dictionary(2, signals, tmp_path / "mod.npy", "runtime", method="mod", n_iter=8)
    assert np.abs(ours - mod).max() < 1e-12


def test_a_rank_with_no_rows_fits_codes_and_decodes_none(signals, tmp_path):
    """The last rank holds no rows: fit, transform and inverse_transform take its none (a rank of several, unlike a
    single process, may hold none; transform once refused them there alone), and the dictionary is the one the
    other ranks' blocks, the same rows in the same order, teach."""
    ours = estimator_dictionary(3, signals, tmp_path / "empty.npy", "empty")
    job = job_dictionary(2, signals, tmp_path / "job.h5")
    assert np.abs(ours - job).max() < 1e-9, np.abs(ours - job).max()


def test_the_ranks_waiting_for_a_late_one_say_what_they_wait_for(signals, tmp_path):
    """MPI's collectives cannot time out: a rank that never calls fit or partial_fit (a branch only some ranks take)
    left the others waiting without a word. After MPISCALE_COLLECTIVE_CHECK_S the waiting ranks say which call they
    wait in; a rank that is only late is waited for, and the dictionary is the one of ranks that came together."""
    late = run_mpi("estimator_fit.py", 3, str(signals), str(tmp_path / "late.npy"), json.dumps(SETTINGS), "late",
                   env={"MPISCALE_COLLECTIVE_CHECK_S": "1"})  # fmt: skip
    assert_ok(late)
    said = "s for the other ranks of its communicator to call fit too: each rank must call it (one without rows"
    for rank in (0, 1):
        assert f"DictionaryLearning.fit: rank {rank} has waited 1 {said}" in late.stderr, late.stderr
    assert "rank 2 has waited" not in late.stderr
    plain = estimator_dictionary(3, signals, tmp_path / "plain.npy")
    assert np.array_equal(np.load(tmp_path / "late.npy"), plain)


def test_inside_the_runtime_a_rank_only_late_is_waited_for(signals, tmp_path):
    """The last rank awaits 3 s before fit, its event loop free: it answers that it is in main, in no collective, and
    the others wait for it rather than end the job."""
    late = run_mpi("estimator_fit.py", 3, str(signals), str(tmp_path / "late.npy"), json.dumps(SETTINGS),
                   "late-runtime", env={"MPISCALE_COLLECTIVE_CHECK_S": "1"})  # fmt: skip
    assert_ok(late)
    assert "DictionaryLearning.fit: rank 0 has waited 1 s" in late.stderr and "CollectiveAbandoned" not in late.stderr
    assert np.array_equal(np.load(tmp_path / "late.npy"), estimator_dictionary(3, signals, tmp_path / "plain.npy"))


LEFT_MAIN = "left main (returned) after 0 collectives on MPI_COMM_WORLD (blocking calls)"
IN_BARRIER = "(0 collectives started on it); it waits in barrier #1 on world for "


@pytest.mark.parametrize("mode, rank_1", [("skips", LEFT_MAIN), ("skips-thread", LEFT_MAIN),
                                          ("skips-for-barrier", IN_BARRIER)])  # fmt: skip
def test_inside_the_runtime_a_rank_that_never_calls_fit_ends_the_job_with_a_report(signals, tmp_path, mode, rank_1):
    """Rank 1 returns from main without fit. Rank 0's fit held its event loop (``skips``: called from main, as most
    code does), where the runtime's watch of abandoned collectives could not run, and it waited forever; the barrier
    that starts fit now asks the other ranks itself. Called off the loop (``skips-thread``), the loop's watch finds
    it in the runtime's logs. Rank 1 waiting in the runtime's world barrier instead waits for rank 0 as rank 0
    waits for it (``skips-for-barrier``)."""
    job = run_mpi("estimator_fit.py", 2, str(signals), str(tmp_path / "x.npy"), json.dumps(SETTINGS), mode,
                  env={"MPISCALE_COLLECTIVE_CHECK_S": "1"}, timeout=60)  # fmt: skip
    assert job.returncode != 0 and job.elapsed < 30, (job.elapsed, job.output[-3000:])
    header = ("CollectiveAbandoned: a collective that not every rank will enter: DictionaryLearning.fit #1 on "
              "MPI_COMM_WORLD (blocking calls) (rank 0 waits in it; rank 1 never will)")  # fmt: skip
    assert job.stderr.count(header) == 1, job.stderr
    assert "waits in DictionaryLearning.fit #1 on MPI_COMM_WORLD (blocking calls) for " in job.stderr, job.stderr
    assert "called at estimator_fit.py:" in job.stderr, job.stderr  # the user's line, not the library's
    assert rank_1 in job.stderr, job.stderr


def test_an_error_no_code_catches_on_one_rank_ends_the_job_under_plain_mpirun(signals, tmp_path):
    """Rank 1 raises before fit and nothing catches it. Its exit finalized MPI, and rank 0 waited in fit for ever;
    importing mpiscale under a launcher makes such an error end every rank, after its traceback."""
    job = run_mpi("estimator_fit.py", 2, str(signals), str(tmp_path / "x.npy"), json.dumps(SETTINGS), "raises",
                  timeout=60)  # fmt: skip
    assert job.returncode != 0 and job.elapsed < 30, (job.elapsed, job.output[-3000:])
    assert "FileNotFoundError: rank 1 could not read its rows" in job.stderr, job.stderr
    assert "mpiscale: rank 1: FileNotFoundError that no code caught: ending every rank of the job" in job.stderr


def test_a_rank_whose_program_ends_without_fit_ends_the_job_at_once_under_plain_mpirun(signals, tmp_path):
    """Rank 1's program ends without fit. Its exit waited in MPI's finalize, and rank 0 in fit, each for the other,
    for ever: rank 0 only said what it waited for, and later found rank 1's end only on its own host. Rank 1's end
    now makes the world's checked exchange that fit begins with: the job ends at once, on any host, naming both."""
    job = run_mpi("estimator_fit.py", 2, str(signals), str(tmp_path / "x.npy"), json.dumps(SETTINGS),
                  "ends-without-fit", timeout=60)  # fmt: skip
    assert job.returncode != 0 and job.elapsed < 20, (job.elapsed, job.output[-3000:])
    assert (
        "CollectiveMismatch: DictionaryLearning.fit: the ranks of its communicator came to different collective "
        "calls: rank 0: DictionaryLearning.fit, at estimator_fit.py:45; rank 1: the end of its program (it returned, "
        "or called sys.exit); each rank of the comm given must make the same collective calls on it, in the same order"
    ) in job.stderr, job.stderr
    assert job.stderr.count("Traceback") == 1 and "rank 0 has waited" not in job.stderr, job.stderr


def test_a_nan_on_one_rank_is_refused_on_every_rank(signals, tmp_path):
    job = run_mpi("estimator_fit.py", 2, str(signals), str(tmp_path / "x.npy"), json.dumps(SETTINGS), "nan")
    assert_ok(job)
    for rank in (0, 1):
        assert f"rank {rank} refused: DictionaryLearning failed: rank 1: " in job.stdout, job.output[-3000:]
    assert "NaN" in job.stdout


def test_a_jobs_results_file_is_a_fitted_estimator(signals, tmp_path):
    out = tmp_path / "job.h5"
    dictionary = job_dictionary(2, signals, out)
    learned = load_results(str(out))
    assert learned.config.atoms == 24 and learned.iterations == 60 and learned.samples == 1003
    assert learned.metrics["error"].shape == (60,) and learned.world_size == 2 and learned.planted is None
    estimator = DictionaryLearning.from_results(str(out), transform_n_nonzero_coefs=2)
    assert estimator.n_components == 24 and estimator.n_iter_ == 60
    assert np.array_equal(estimator.components_, dictionary)
    with h5py.File(signals, "r") as file:
        rows = file["signals"][:200]
    codes = estimator.transform(rows)
    assert codes.shape == (200, 24) and (np.count_nonzero(codes, axis=1) <= 2).all()
    assert np.linalg.norm(rows - estimator.inverse_transform(codes)) < 0.5 * np.linalg.norm(rows)
    estimator.partial_fit(rows)  # goes on from the job's dictionary
    assert estimator.n_iter_ == 61
