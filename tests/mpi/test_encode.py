"""``mpiscale encode`` as users run it: a dictionary learned by the job (or any array of atoms), signals written
with h5py or numpy, codes in CSR that scipy reads and that equal one process's, a stopped or killed run resumed on
another number of ranks, and refusals in one line."""

import shutil
import sys
import time

import h5py
import numpy as np
import pytest
from helpers import assert_ok, finish, held_at_step, interrupt, launch, run_alone, run_cli, run_mpi

from mpiscale.dictlearn import lasso_encode, load_codes, load_results, omp_encode
from mpiscale.dictlearn.synthetic import planted_dictionary
from mpiscale.io import DataFileError, read_dataset


@pytest.fixture(scope="module")
def learned(tmp_path_factory):
    """A dictionary of 32 atoms of 16 values learned by the job (with mean removal), and 2,003 signals a user wrote:
    float32, chunked and compressed."""
    folder = tmp_path_factory.mktemp("encode")
    rng = np.random.default_rng(5)
    atoms = planted_dictionary(32, 16, 6)
    codes = np.zeros((2003, 32))
    for row in codes:
        row[rng.choice(32, 4, replace=False)] = rng.standard_normal(4)
    signals = (codes @ atoms + 0.05 * rng.standard_normal((2003, 16)) + rng.normal(3, 1, (2003, 1))).astype("f4")
    with h5py.File(folder / "signals.h5", "w") as file:
        file.create_dataset("X", data=signals, chunks=(100, 16), compression="gzip")
    job = run_cli(
        2,
        "dictlearn",
        "--data",
        f"{folder / 'signals.h5'}:/X",
        "--atoms",
        "32",
        "--sparsity",
        "4",
        "--remove-mean",
        "--iterations",
        "100",
        "--out",
        folder / "dictionary.h5",
        "--progress-every",
        "0",
    )
    assert_ok(job)  # fmt: skip
    return folder, signals.astype(np.float64), load_results(str(folder / "dictionary.h5")).dictionary


def test_codes_equal_one_process_and_scipy_reads_them(learned, tmp_path, ranks):
    folder, signals, atoms = learned
    out = tmp_path / "codes.h5"
    job = run_cli(ranks, "encode", "--dictionary", folder / "dictionary.h5", "--data", f"{folder / 'signals.h5'}:/X",
                  "--batch-size", "97", "--out", out)  # fmt: skip
    assert_ok(job)
    assert f"wrote {out}: codes of 2,003 signals over 32 atoms" in job.stdout, job.stdout
    centred = signals - signals.mean(axis=1, keepdims=True)  # auto: as the dictionary was learned
    expected = omp_encode(centred, atoms, 4)
    codes = load_codes(str(out))
    matrix = codes.to_scipy()
    assert matrix.shape == (2003, 32) and matrix.has_sorted_indices and (np.diff(codes.indptr) <= 4).all()
    assert np.abs(matrix.toarray() - expected).max() < 1e-12
    assert np.allclose(codes.residual_norm, np.linalg.norm(centred - expected @ atoms, axis=1), atol=1e-12)
    assert np.allclose(codes.mean, signals.mean(axis=1), atol=1e-12)
    assert np.abs(codes.signals() - (expected @ atoms + codes.mean[:, None])).max() < 1e-12
    with h5py.File(out, "r") as file:  # plain h5py, as a user reads it
        assert file.attrs["format"] == "mpiscale.codes/1" and file.attrs["rows_done"] == 2003
        assert file["codes/indptr"][-1] == len(file["codes/data"]) == file.attrs["nnz_done"]
    shown = run_alone("inspect", out)
    assert "codes of 2,003 signals over 32 atoms (omp, at most 4 atoms, each signal less its mean)" in shown.stdout
    assert np.array_equal(read_dataset(out, "codes"), matrix.toarray())  # the codes as any job's input: dense rows


def test_an_error_target_and_lasso_with_a_users_own_atoms(learned, tmp_path):
    folder, signals, atoms = learned
    np.save(tmp_path / "atoms.npy", atoms)  # a dictionary from elsewhere: a plain array, no settings with it
    data = f"{folder / 'signals.h5'}:/X"
    target = tmp_path / "target.h5"
    assert_ok(run_cli(2, "encode", "--dictionary", tmp_path / "atoms.npy", "--data", data, "--sparsity", "12",
                      "--max-residual", "0.3", "--remove-mean", "yes", "--out", target))  # fmt: skip
    centred = signals - signals.mean(axis=1, keepdims=True)
    expected = omp_encode(centred, atoms, 12, max_residual=0.3)
    codes = load_codes(str(target))
    assert np.abs(codes.to_scipy().toarray() - expected).max() < 1e-12 and (codes.residual_norm <= 0.3 + 1e-9).all()
    scales = np.random.default_rng(3).uniform(0.1, 10, (32, 1))  # atoms of other norms (NMF's, say) were refused
    np.save(tmp_path / "scaled.npy", atoms * scales)
    scaled = tmp_path / "scaled.h5"
    assert_ok(run_cli(2, "encode", "--dictionary", tmp_path / "scaled.npy", "--data", data, "--sparsity", "4",
                      "--out", scaled))  # fmt: skip
    unit = omp_encode(signals, atoms, 4)
    assert np.abs(load_codes(str(scaled)).to_scipy().toarray() * scales[:, 0] - unit).max() < 1e-9
    lasso = tmp_path / "lasso.h5"
    assert_ok(run_cli(2, "encode", "--dictionary", tmp_path / "atoms.npy", "--data", data, "--coder", "lasso",
                      "--alpha", "0.2", "--out", lasso))  # fmt: skip
    codes = load_codes(str(lasso))
    assert codes.mean is None  # a plain array says nothing of means: auto is no
    assert np.abs(codes.to_scipy().toarray() - lasso_encode(signals, atoms, 0.2)).max() < 1e-9


def _assert_unfinished(kept, out, done: int) -> None:
    """``inspect`` of a stopped or killed run's file says how many signals it coded and how to finish, its numbers
    over those (they counted the empty rows after them in: "0.00 a signal", the fewest negative), and
    ``load_codes`` refuses it (it gave codes whose rows after those were garbage)."""
    shown = run_alone("inspect", kept)
    assert_ok(shown)
    assert (
        f"signals: {done:,} of 2,003 coded; mpiscale encode --resume --out {out}, with the settings of the run, "
        "codes the others" in shown.stdout
    ), shown.stdout
    assert f"non-zeros over the {done:,} coded: " in shown.stdout and "fewest -" not in shown.stdout, shown.stdout
    with pytest.raises(DataFileError, match=rf"holds {done:,} of its 2,003 signals, an unfinished run's \(the "):
        load_codes(str(kept))


def test_a_stopped_and_a_killed_run_go_on_from_their_last_round_on_other_rank_counts(learned, tmp_path):
    """Each resumed run's codes equal one process's; a resume after the dictionary was learned again, or the data
    written again, under the same name is refused (it went on without a word, coding the rest with other atoms than
    the file holds, or other signals), down to one value's last bit in the data's middle."""
    folder, signals, atoms = learned
    dictionary, data = tmp_path / "dictionary.h5", tmp_path / "signals.h5"
    shutil.copyfile(folder / "dictionary.h5", dictionary)
    shutil.copyfile(folder / "signals.h5", data)
    common = ["encode", "--dictionary", str(dictionary), "--data", f"{data}:/X",
              "--batch-size", "10", "--progress-every", "0.001"]  # fmt: skip
    whole = tmp_path / "whole.h5"
    assert_ok(run_cli(1, *common, "--out", whole))
    expected = load_codes(str(whole))
    for way, then in (("stopped", 4), ("killed", 1)):
        out, log = tmp_path / f"{way}.h5", tmp_path / f"{way}.log"
        with open(log, "w") as stdout:
            process = launch(2, [sys.executable, "-m", "mpiscale.cli", *common, "--out", str(out)], stdout=stdout)
            with held_at_step(process, log, str(out), "round", 5) as (ranks, _):
                interrupt(ranks, way)
            ended = finish(process, f"encode {way}", 60)
        assert ended.returncode != 0 and not out.exists(), ended.output[-3000:]
        kept = tmp_path / (f"{way}.h5.partial" if way == "stopped" else f"{way}.h5.tmp")
        with h5py.File(kept, "r") as file:
            done = int(file.attrs["rows_done"])
        assert 0 < done < 2003, done
        _assert_unfinished(kept, out, done)
        if way == "killed":  # (the rows after the mark hold what the killed run began of them)
            learn = run_alone("dictlearn", "--data", f"{kept}:/codes", "--atoms", "4", "--out", tmp_path / "d.h5")
            refusal = (
                f"holds {done:,} of its 2,003 signals, an unfinished run's (the others hold nothing yet): "
                f"mpiscale encode --resume --out {out},"
            )
            assert learn.returncode == 2 and refusal in learn.stderr, learn.stderr
        plain = run_cli(2, *common, "--out", out)
        said = plain.stderr.splitlines()
        assert plain.returncode == 2 and "pass --resume" in said[-1], plain.stderr
        taken_over = way == "killed" and "taking over the lock" in said[0]  # the killed run left its lock
        assert len(said) == 1 or (taken_over and len(said) == 2), plain.stderr
        if way == "stopped":
            for changed, name, row, said in [(dictionary, "dictionary", -1, "the dictionary's atoms: other values in "),
                                             (data, "X", 1000, "the data's values: other values in ")]:  # fmt: skip
                with h5py.File(changed, "r+") as file:  # (one value of one signal in the data's middle)
                    file[name][row, 3] = np.nextafter(file[name][row, 3], np.inf)
                refused = run_cli(2, *common, "--out", out, "--resume")
                assert refused.returncode == 2 and said in refused.stderr, refused.stderr
                shutil.copyfile(folder / changed.name, changed)
        resumed = run_cli(then, *common, "--out", out, "--resume")
        assert_ok(resumed)
        assert f"resumed from {kept}: {done:,} of 2,003 signals were coded" in resumed.stdout, resumed.stdout
        codes = load_codes(str(out))
        assert np.array_equal(codes.indptr, expected.indptr) and np.array_equal(codes.indices, expected.indices)
        assert np.abs(codes.data - expected.data).max() < 1e-12 and not kept.exists()


def test_an_error_in_one_ranks_coding_ends_the_job_with_its_report(learned, tmp_path):
    """Rank 1's coding raises in its second round (a GPU out of memory on one rank): the steps closed the data set
    as the error left them, a collective close with MPI-IO, while rank 0 waited in the round's write: the job hung
    with the error unsaid. It ends now with rank 1's report."""
    folder, _, _ = learned
    started = time.monotonic()
    job = run_mpi("one_rank_fails.py", 2, "mpiscale.dictlearn.encode", "omp_rows", "2", "encode", "--dictionary",
                  str(folder / "dictionary.h5"), "--data", f"{folder / 'signals.h5'}:/X", "--batch-size", "100",
                  "--out", str(tmp_path / "codes.h5"), timeout=120)  # fmt: skip
    assert job.returncode != 0 and time.monotonic() - started < 60, job.output[-3000:]
    assert "job failed on rank 1 of 2" in job.stderr and "CUDA out of memory (planted on rank 1" in job.stderr
    assert not (tmp_path / "codes.h5").exists()


def test_what_cannot_be_coded_is_refused_in_one_line(learned, tmp_path):
    folder, signals, atoms = learned
    data = f"{folder / 'signals.h5'}:/X"
    np.save(tmp_path / "transposed.npy", atoms.T)  # SPAMS keeps its atoms as columns
    np.save(tmp_path / "zero.npy", np.where(np.arange(32)[:, None] == 5, 0.0, atoms))
    np.save(tmp_path / "square.npy", atoms[:16])  # (complete: as many atoms as features)
    np.save(tmp_path / "square-columns.npy", atoms[:16].T)  # (a square shape let SPAMS's layout through)
    with h5py.File(tmp_path / "nan.h5", "w") as file:
        file["X"] = np.where(np.arange(16) == 3, np.nan, signals[:50])
    cases = [
        (["--dictionary", tmp_path / "transposed.npy", "--data", data], "a SPAMS dictionary is features x atoms"),
        (["--dictionary", tmp_path / "zero.npy", "--data", data], "atom 5 is all zeros"),
        (
            ["--dictionary", tmp_path / "square-columns.npy", "--data", data],
            "square-columns.npy: the dictionary is "
            "square (16 x 16) and its columns are unit vectors, its rows not: its atoms look kept as columns",
        ),
        (["--dictionary", folder / "dictionary.h5", "--data", f"{tmp_path / 'nan.h5'}:/X"], "signal 0 holds NaN"),
        (["--dictionary", folder / "dictionary.h5", "--data", data, "--sparsity", "40"], "sparsity 40 exceeds"),
        (["--dictionary", folder / "dictionary.h5"], "give --dictionary"),
    ]
    for options, message in cases:
        job = run_cli(2, "encode", *options, "--out", tmp_path / "refused.h5")
        assert job.returncode == 2 and message in job.stderr and job.stderr.count("\n") == 1, job.output[-2000:]
    same = run_cli(
        2, "encode", "--dictionary", folder / "dictionary.h5", "--data", data, "--out", folder / "signals.h5"
    )
    assert same.returncode == 2 and "signals.h5" in same.stderr and same.stderr.count("\n") == 1, same.stderr
    assert not list(tmp_path.glob("refused.h5*"))
    assert_ok(run_cli(2, "encode", "--dictionary", tmp_path / "square.npy", "--data", data, "--out",
                      tmp_path / "square-codes.h5"))  # fmt: skip


def test_a_dictionary_too_large_for_the_hosts_memory_is_refused_before_it_is_allocated(tmp_path):
    """300,000 atoms learned, or 200,000 atoms coded with, on 2 ranks of one host: each rank's matrices of atoms x
    atoms float64 (two to learn, the Gram matrix to code) outgrow any host's memory. 60,000 atoms on this 24 GiB
    host ended with numpy's "Unable to allocate 26.8 GiB for an array with shape (60000, 60000)" in a traceback,
    mid-start (with less than the host holds per rank, the kernel's OOM killer may end a rank without a word). Both
    are refused in one line, status 2, nothing written."""
    learn = run_cli(2, "dictlearn", "--atoms", 300000, "--features", 16, "--samples", 1000, "--sparsity", 2,
                    "--out", tmp_path / "d.h5")  # fmt: skip
    assert learn.returncode == 2 and learn.stderr.count("\n") == 1, learn.output[-3000:]
    said = (
        "mpiscale dictlearn: 300000 atoms keep matrices of 300000 x 300000 numbers on every rank: at least 2682.2 GiB"
    )
    assert said + " for the 2 ranks of host " in learn.stderr, learn.stderr
    assert "use fewer atoms (or fewer ranks a host)" in learn.stderr
    np.save(tmp_path / "atoms.npy", np.random.default_rng(0).standard_normal((200000, 16)))
    with h5py.File(tmp_path / "signals.h5", "w") as file:
        file["X"] = np.random.default_rng(1).standard_normal((100, 16))
    code = run_cli(2, "encode", "--dictionary", tmp_path / "atoms.npy", "--data", f"{tmp_path / 'signals.h5'}:/X",
                   "--out", tmp_path / "c.h5")  # fmt: skip
    said = "mpiscale encode: 200000 atoms keep matrices of 200000 x 200000 numbers on every rank: at least 596.0 GiB"
    assert code.returncode == 2 and said in code.stderr, code.output[-3000:]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["atoms.npy", "signals.h5"]
