"""`mpiscale dictlearn` as users run it: real mpirun jobs, real parallel HDF5 data, results and checkpoints."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers import (
    REPO,
    SESSION_ENVIRONMENT,
    assert_ok,
    finish,
    gpu_ranks,
    launch,
    on_a_gpu,
    real_gpu,
    run_alone,
    run_mpi,
)

KSVD = ["--atoms", "50", "--sparsity", "3", "--samples", "1500", "--features", "20"]


def dictlearn(ranks: int, out, *options: str, timeout: float = 120, env: dict | None = None):
    """Run the job writing ``out``; returns the finished job (not checked)."""
    command = [sys.executable, "-m", "mpiscale.cli", "dictlearn", "--out", str(out), "--progress-every", "0", *options]
    return finish(launch(ranks, command, env=env), f"dictlearn {' '.join(options)} on {ranks} ranks", timeout)


def learned(out) -> np.ndarray:
    with h5py.File(out, "r") as file:
        return file["dictionary"][()]


def test_ksvd_setting_recovers_the_planted_dictionary(tmp_path, ranks):
    """K-SVD's experiment (20 features, 50 atoms, 3 non-zeros, 1,500 signals, no noise): >= 90% recovered."""
    out = tmp_path / "results.h5"
    job = dictlearn(ranks, out, *KSVD, "--iterations", "300", "--progress-every", "0.01")  # the run may take 0.7 s
    assert_ok(job)
    assert "iteration 300/300" in job.stdout and "signals/s" in job.stdout and "ETA" in job.stdout
    with h5py.File(out, "r") as file:
        assert file.attrs["format"] == "mpiscale.dictlearn-results/1"
        assert file.attrs["world_size"] == ranks
        assert file.attrs["recovery_rate"] >= 0.9, file.attrs["recovery_rate"]
        assert json.loads(file.attrs["config"])["atoms"] == 50
        assert file["dictionary"].shape == (50, 20) and file["planted_dictionary"].shape == (50, 20)
        assert np.allclose(np.linalg.norm(file["dictionary"][()], axis=1), 1.0)
        metrics = file["metrics"]
        assert metrics["objective"].shape == (300,) and metrics["atom_usage"].shape == (300, 50)
        assert file.attrs["iterations"] == 300 and list(metrics["iteration"][-2:]) == [299, 300]
        assert metrics["atom_usage"][()].sum() == round(metrics["sparsity"][()].sum() * 256)
        assert metrics["error"][-20:].mean() < 0.5 * metrics["error"][:20].mean()
        assert (metrics["sparsity"][()] <= 3).all() and (metrics["comm_s"][()] > 0).all()
    print(f"recovered at {ranks} ranks, no noise: {file_rate(out):.0%}")


def file_rate(out) -> float:
    with h5py.File(out, "r") as file:
        return float(file.attrs["recovery_rate"])


def test_recovery_at_20_db_noise_is_reported(tmp_path):
    out = tmp_path / "noisy.h5"
    assert_ok(dictlearn(2, out, *KSVD, "--iterations", "300", "--snr-db", "20"))
    rate = file_rate(out)
    print(f"recovered at 20 dB: {rate:.0%}")
    assert rate >= 0.8


def test_same_dictionary_on_1_2_and_4_ranks(tmp_path):
    """The global batches and the summed statistics do not depend on the number of ranks."""
    dictionaries = []
    for ranks in (1, 2, 4):
        out = tmp_path / f"ranks{ranks}.h5"
        assert_ok(dictlearn(ranks, out, *KSVD, "--iterations", "150"))
        dictionaries.append(learned(out))
    assert np.abs(dictionaries[0] - dictionaries[1]).max() < 1e-9
    assert np.abs(dictionaries[0] - dictionaries[2]).max() < 1e-9


def test_ranks_with_no_rows_learn_what_one_rank_learns(tmp_path):
    """3 signals in a user's .npy on 4 ranks: online batches of 2 leave two ranks without a row in every round, and
    mod's whole data set leaves one rank none (its default --batch-size of 256, an online setting, is not held
    against the 3 signals). Each learns the one-rank dictionary."""
    data = tmp_path / "three.npy"
    np.save(data, np.random.default_rng(5).standard_normal((3, 20)))
    small = ["--data", str(data), "--atoms", "2", "--sparsity", "1", "--iterations", "4"]
    for method in (["--batch-size", "2"], ["--method", "mod"]):
        dictionaries = []
        for ranks in (1, 4):
            out = tmp_path / f"{method[-1]}-{ranks}.h5"
            assert_ok(dictlearn(ranks, out, *small, *method))
            dictionaries.append(learned(out))
        assert np.abs(dictionaries[0] - dictionaries[1]).max() < 1e-12, method


def test_replacements_are_chosen_for_the_whole_batch_on_1_to_4_ranks(tmp_path):
    """Handwritten digits (8x8 images written by plain h5py) with far more atoms than they need: more atoms go idle
    every iteration than --max-replace allows, and each rank's worst signals must not add up to more replacements.
    Then a run stopped at its checkpoint of iteration 20 on 2 ranks resumes on 3 to the same dictionary."""
    from sklearn.datasets import load_digits

    data = tmp_path / "digits.h5"
    with h5py.File(data, "w") as file:
        file.create_dataset("images", data=load_digits().images.astype(np.uint8), chunks=(100, 8, 8))
    learning = ["--data", f"{data}:/images", "--atoms", "150", "--sparsity", "2", "--max-replace", "3",
                "--replace-after", "1"]  # fmt: skip
    options = [*learning, "--iterations", "40"]
    dictionaries, replaced = [], []
    for ranks in (1, 2, 3, 4):
        out = tmp_path / f"ranks{ranks}.h5"
        assert_ok(dictlearn(ranks, out, *options))
        dictionaries.append(learned(out))
        with h5py.File(out, "r") as file:
            replaced.append(file["metrics"]["replaced"][()])
    assert replaced[0].max() == 3 and (replaced[0] == 3).sum() > 10, replaced[0]  # the cap binds
    for ranks, dictionary, count in zip((2, 3, 4), dictionaries[1:], replaced[1:]):
        np.testing.assert_array_equal(count, replaced[0], err_msg=f"{ranks} ranks")
        assert np.abs(dictionary - dictionaries[0]).max() < 1e-9, ranks
    stopped = tmp_path / "stopped.h5"
    first = [*learning, "--iterations", "20", "--checkpoint-every", "10"]
    assert_ok(dictlearn(2, stopped, *first))
    resumed = [*options, "--checkpoint-every", "10", "--checkpoint-dir", str(tmp_path / "stopped.checkpoints")]
    assert_ok(dictlearn(3, tmp_path / "resumed.h5", *resumed, "--resume"))
    assert np.abs(learned(tmp_path / "resumed.h5") - dictionaries[0]).max() < 1e-9


def test_killed_run_resumes_on_another_world_size(tmp_path):
    """Rank 1 SIGKILLed after the checkpoint of iteration 60; resumed on 4 ranks it ends as an uninterrupted run."""
    options = [*KSVD, "--iterations", "150", "--checkpoint-every", "20", "--snr-db", "20"]
    crashed = run_mpi("dictlearn_crash.py", 2, "60", "--out", str(tmp_path / "a.h5"), *options, timeout=120)
    assert crashed.returncode != 0 and not (tmp_path / "a.h5").exists()
    resumed = dictlearn(4, tmp_path / "a.h5", *options, "--resume")
    assert_ok(resumed)
    assert "resumed from the checkpoint of iteration 60" in resumed.stdout
    assert_ok(dictlearn(3, tmp_path / "b.h5", *options))
    assert np.abs(learned(tmp_path / "a.h5") - learned(tmp_path / "b.h5")).max() < 1e-9
    with h5py.File(tmp_path / "a.h5", "r") as a, h5py.File(tmp_path / "b.h5", "r") as b:
        assert a["metrics"]["objective"].shape == (150,)
        assert np.array_equal(a["metrics"]["atom_usage"][()], b["metrics"]["atom_usage"][()])


def test_an_error_in_one_ranks_coding_ends_the_job_with_its_report(tmp_path):
    """Rank 1's coding raises in its third iteration (a GPU out of memory on one rank): the iterations closed their
    reader as the error left them, a collective close with MPI-IO, while rank 0 waited in the iteration's allreduce:
    the job hung with the error unsaid. It ends now with rank 1's report."""
    started = time.monotonic()
    planted = ("mpiscale.dictlearn.iteration", "omp_rows_gram", "3")  # rank 1 raises in its 3rd call
    job = run_mpi("one_rank_fails.py", 2, *planted, "dictlearn", *KSVD, "--iterations", "50", "--progress-every", "0",
                  "--out", str(tmp_path / "a.h5"), timeout=120)  # fmt: skip
    assert job.returncode != 0 and time.monotonic() - started < 60, job.output[-3000:]
    assert "job failed on rank 1 of 2" in job.stderr and "CUDA out of memory (planted on rank 1" in job.stderr
    assert not (tmp_path / "a.h5").exists()


def test_long_runs_keep_about_a_thousand_rows_of_metrics(tmp_path):
    out = tmp_path / "long.h5"
    assert_ok(dictlearn(2, out, *KSVD, "--iterations", "2500", "--checkpoint-every", "1000"))
    with h5py.File(out, "r") as file:
        metrics = file["metrics"]
        assert metrics.attrs["every"] == 3 and metrics["objective"].shape == (834,)
        assert list(metrics["iteration"][-2:]) == [2499, 2500]
        per_row = np.diff(metrics["iteration"][()], prepend=0)  # iterations in each row
        assert metrics["atom_usage"][()].sum() == round((metrics["sparsity"][()] * per_row).sum() * 256)
        assert file.attrs["iterations"] == 2500


@pytest.fixture(scope="module")
def signals_file(tmp_path_factory):
    """A real data set (written collectively by a 2-rank job), plus a copy with one NaN."""
    directory = tmp_path_factory.mktemp("data")
    out = directory / "make.h5"
    assert_ok(dictlearn(2, out, *KSVD, "--iterations", "1"))
    data = directory / "make.synthetic.h5"
    with h5py.File(data, "r") as source:
        signals = source["signals"][()]
    broken = directory / "nan.h5"
    with h5py.File(data, "r") as source, h5py.File(broken, "w") as target:
        for name, value in source.attrs.items():
            target.attrs[name] = value
        signals[777, 3] = np.nan
        target["signals"] = signals
    return data, broken


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--data", "{data}:/missing"], "no dataset 'missing'"),
        (["--data", "{nan}:/signals"], "signal 777 holds NaN"),
        (["--data", "{data}:/signals", "--atoms", "2000"], "2000 atoms need at least as many signals"),
        (["--data", "{data}:/signals", "--sparsity", "60", "--atoms", "60"], "sparsity 60 exceeds the signal length"),
        (["--data", "{data}:/signals", "--atoms", "10", "--sparsity", "11"], "sparsity 11 exceeds the number of atoms"),
        (["--data", "{data}"], "holds 2 data sets; name one as"),
        (["--data", "{data}:/signals", "--out", "{data}/x.h5"], "is a file, not a directory"),
    ],
    ids=["dataset", "nan", "atoms", "sparsity-features", "sparsity-atoms", "no-dataset-name", "out-under-a-file"],
)
def test_bad_input_is_refused_before_anything_is_written(tmp_path, signals_file, options, message):
    data, broken = signals_file
    out = tmp_path / "results.h5"
    with h5py.File(out, "w") as older:  # an earlier run's results, which a rerun may replace, a refused one not
        older.attrs["format"] = "mpiscale.dictlearn-results/1"
    before = out.read_bytes()
    options = [o.format(data=data, nan=broken) for o in options]
    job = dictlearn(2, out, *options, "--checkpoint-every", "5")
    assert job.returncode != 0
    assert message in job.stderr, job.stderr[-3000:]
    assert "Traceback" not in job.stderr
    assert out.read_bytes() == before
    assert not (tmp_path / "results.checkpoints").exists() or not any((tmp_path / "results.checkpoints").glob("step-*"))


def test_incompatible_or_unasked_checkpoints_are_refused(tmp_path, signals_file):
    """Other settings, data written again under the same name (one value's last bit, in the middle: a resume went
    on learning from it without a word), and checkpoints a run did not ask to resume are refused."""
    data = tmp_path / "signals.h5"
    shutil.copyfile(signals_file[0], data)
    out = tmp_path / "results.h5"
    base = ["--data", f"{data}:/signals", "--iterations", "20", "--checkpoint-every", "10"]
    assert_ok(dictlearn(2, out, *base))
    before = out.read_bytes()
    job = dictlearn(2, out, *base, "--atoms", "40", "--resume")
    assert job.returncode != 0 and "belongs to another job (atoms: checkpoint 50, now 40)" in job.stderr
    assert "restored checkpoint" not in job.output, job.output  # it was said before the refusal
    with h5py.File(data, "r+") as file:
        file["signals"][1000, 3] = np.nextafter(file["signals"][1000, 3], np.inf)
    job = dictlearn(3, out, *base, "--iterations", "30", "--resume")
    assert job.returncode == 2 and "the data's values differ from those the checkpoint learned from" in job.stderr
    assert "belongs to another job (data: checkpoint '" in job.stderr, job.stderr
    job = dictlearn(2, out, *base)
    assert job.returncode != 0 and "pass --resume" in job.stderr
    assert out.read_bytes() == before


def test_mod_and_lasso_variants_learn(tmp_path):
    mod = tmp_path / "mod.h5"
    assert_ok(dictlearn(2, mod, *KSVD, "--method", "mod", "--iterations", "30"))
    lasso = tmp_path / "lasso.h5"
    assert_ok(dictlearn(2, lasso, *KSVD, "--coder", "lasso", "--alpha", "0.05", "--iterations", "200"))
    for out in (mod, lasso):
        with h5py.File(out, "r") as file:
            error = file["metrics"]["error"][()]
            assert error[-5:].mean() < 0.6 * error[:3].mean(), error
            assert file.attrs["recovery_rate"] >= 0.5
    with h5py.File(lasso, "r") as file:
        assert file["metrics"]["sparsity"][-1] > 3  # the L1 penalty, not L, sets the sparsity


def test_inspect_prints_a_summary_and_plots(tmp_path):
    out = tmp_path / "results.h5"
    assert_ok(dictlearn(2, out, *KSVD, "--iterations", "50", "--eval-every", "10"))
    image = tmp_path / "curves.png"
    job = finish(
        launch(1, [sys.executable, "-m", "mpiscale.cli", "inspect", str(out), "--plot", str(image)]), "inspect", 60
    )
    assert_ok(job)
    assert "50 atoms of 20 features" in job.stdout and "planted atoms recovered" in job.stdout
    assert "whole-data error" in job.stdout and "communication" in job.stdout
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a name without a suffix is drawn as PNG, and said as the file it is; a format matplotlib does not draw, or the
    # results file itself, is refused in one line (--plot results.h5 ended in matplotlib's traceback)
    bare = run_alone("inspect", out, "--plot", tmp_path / "bare")
    assert_ok(bare)
    assert f"wrote {tmp_path / 'bare.png'}" in bare.stdout and (tmp_path / "bare.png").is_file()
    (tmp_path / "same.png").symlink_to(out)
    for plot, said in [(out, "matplotlib draws"), (tmp_path / "same.png", "is the results file itself")]:
        refused = run_alone("inspect", out, "--plot", plot)
        assert refused.returncode == 2 and said in refused.stderr and "Traceback" not in refused.stderr, refused
    with h5py.File(out, "r") as file:
        assert file.attrs["format"] == "mpiscale.dictlearn-results/1"  # the results file is left as it was


def test_reconstruction_error_no_worse_than_scikit_learn(tmp_path, signals_file):
    """At equal sparsity (OMP, 3 non-zeros, on every signal), our dictionary reconstructs at least as well."""
    from sklearn.decomposition import MiniBatchDictionaryLearning

    from mpiscale.dictlearn import omp_encode

    data, _ = signals_file
    out = tmp_path / "ours.h5"
    assert_ok(dictlearn(2, out, "--data", f"{data}:/signals", "--atoms", "50", "--iterations", "60"))
    with h5py.File(data, "r") as file:
        signals = file["signals"][()]
    theirs = MiniBatchDictionaryLearning(n_components=50, batch_size=256, max_iter=10, random_state=0).fit(signals)

    def error(dictionary):
        codes = omp_encode(signals, dictionary, 3)
        return np.linalg.norm(signals - codes @ dictionary) / np.linalg.norm(signals)

    ours, reference = error(learned(out)), error(theirs.components_)
    print(f"relative error at 3 non-zeros: ours {ours:.4f}, scikit-learn {reference:.4f}")
    assert ours <= reference


def test_whole_data_error_in_chunks_is_the_error_of_every_signal(tmp_path):
    """--eval-every codes a rank's rows a chunk at a time (each rank holds more than one chunk, the last one short):
    the error it records is the one of all signals coded at once, from a user's .npy file."""
    from mpiscale.dictlearn import omp_encode
    from mpiscale.dictlearn.learner import EVAL_ROWS

    rng = np.random.default_rng(5)
    atoms = rng.standard_normal((40, 16))
    codes = rng.standard_normal((2 * EVAL_ROWS + 3003, 40)) * (rng.random((2 * EVAL_ROWS + 3003, 40)) < 0.08)
    signals = codes @ atoms + 0.05 * rng.standard_normal((len(codes), 16))
    np.save(tmp_path / "signals.npy", signals)
    out = tmp_path / "r.h5"
    options = ["--data", str(tmp_path / "signals.npy"), "--atoms", "40", "--sparsity", "4", "--iterations", "6"]
    assert_ok(dictlearn(2, out, *options, "--eval-every", "3"))
    with h5py.File(out, "r") as file:
        recorded = file["metrics"]["full_error"][()]
    dictionary = learned(out)
    direct = np.linalg.norm(signals - omp_encode(signals, dictionary, 4) @ dictionary) / np.linalg.norm(signals)
    assert np.isnan(recorded[0]) and recorded[-1] == pytest.approx(direct, rel=1e-12), (recorded, direct)


def test_cuda_device_learns_the_cpu_dictionary_on_the_simulator(tmp_path):
    """--device cuda end to end (GPU choice per rank, kernel, provenance), on Numba's CUDA simulator: its one GPU
    refused to two ranks in one line, then shared on purpose."""
    options = [*KSVD, "--iterations", "3", "--batch-size", "16"]  # the simulator runs a kernel thread by thread
    assert_ok(dictlearn(2, tmp_path / "cpu.h5", *options, "--device", "cpu"))
    command = [sys.executable, "-m", "mpiscale.cli", "dictlearn", "--out", str(tmp_path / "gpu.h5"), *options]
    simulated = {"NUMBA_ENABLE_CUDASIM": "1"}
    crowded = finish(launch(2, [*command, "--device", "cuda"], env=simulated), "crowded cuda dictlearn", 180)
    assert crowded.returncode == 2 and crowded.stderr.count("\n") == 1, crowded.output[-3000:]
    assert "ranks 0-1 of this host would share GPU GPU-simulated-0" in crowded.stderr
    shared = simulated | {"MPISCALE_SHARE_GPUS": "1"}
    job = finish(launch(2, [*command, "--device", "cuda"], env=shared), "cuda dictlearn", 180)
    assert_ok(job)
    assert np.abs(learned(tmp_path / "gpu.h5") - learned(tmp_path / "cpu.h5")).max() < 1e-9
    with h5py.File(tmp_path / "gpu.h5", "r") as file:
        assert file.attrs["device"] == "cuda:0"


def test_cuda_device_learns_the_cpu_dictionary_on_a_real_gpu(tmp_path):
    """--device cuda end to end on a real GPU, against the CPU run (skipped without one)."""
    if not real_gpu():
        pytest.skip("no CUDA GPU on this machine (make gpu-check runs this where there is one)")
    options = [*KSVD, "--iterations", "100"]
    ranks, env = gpu_ranks()[-1]  # 2 where h5py has MPI (else make gpu-check fails saying so), the GPU shared
    assert_ok(dictlearn(ranks, tmp_path / "cpu.h5", *options, "--device", "cpu"))
    assert_ok(dictlearn(ranks, tmp_path / "gpu.h5", *options, "--device", "cuda", env=env))
    difference = np.abs(learned(tmp_path / "gpu.h5") - learned(tmp_path / "cpu.h5")).max()
    print(f"--device cuda against cpu after 100 iterations: largest difference {difference:.2e}")
    assert difference < 1e-6
    with h5py.File(tmp_path / "gpu.h5", "r") as file:
        assert on_a_gpu(file.attrs), file.attrs["device"]


@pytest.mark.parametrize("periodic", [["--checkpoint-every", "50"], []], ids=["periodic-checkpoints", "none"])
def test_sigterm_stops_the_job_and_it_resumes(tmp_path, periodic):
    """Preemption as Slurm does it: SIGTERM mid-run stops every rank after the same iteration, with a checkpoint
    of it and the results so far, within seconds; the resumed run (on another world size) matches. Without
    periodic checkpoints too: a job that can resume checkpoints when it is stopped."""
    options = [*KSVD, *periodic, "--snr-db", "20"]
    command = [sys.executable, "-m", "mpiscale.cli", "dictlearn", "--out", str(tmp_path / "a.h5"), *options]
    process = launch(2, [*command, "--iterations", "1000000"], env={"MPISCALE_TELEMETRY_INTERVAL_S": "0.1"})
    latest, telemetry = tmp_path / "a.checkpoints" / "latest", tmp_path / "a.h5.telemetry.jsonl"

    def far_enough() -> bool:
        if periodic:
            return latest.exists() and int(latest.read_text()) >= 100
        lines = telemetry.read_text().splitlines()[:-1] if telemetry.exists() else []  # (the last may be partial)
        steps = [json.loads(line).get("step", 0) for line in lines]
        return max(steps, default=0) >= 100

    deadline = time.monotonic() + 60
    while not far_enough() and time.monotonic() < deadline:
        if process.poll() is not None:
            break
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    stopped = finish(process, "dictlearn after SIGTERM", 30)
    assert stopped.returncode != 0 and "SIGTERM received, stopping after the current step" in stopped.stderr
    step = int(latest.read_text())
    assert f"stopped on request (a stop command or SIGTERM) after iteration {step}" in stopped.stdout
    with h5py.File(tmp_path / "a.h5", "r") as results:
        assert results.attrs["stop_reason"] == "stopped" and results.attrs["iterations"] == step
    total = str(step + 40)
    resumed = dictlearn(4, tmp_path / "a.h5", *options, "--iterations", total, "--resume")
    assert_ok(resumed)
    assert f"resumed from the checkpoint of iteration {step}" in resumed.stdout
    assert_ok(dictlearn(3, tmp_path / "b.h5", *options, "--iterations", total))
    assert np.abs(learned(tmp_path / "a.h5") - learned(tmp_path / "b.h5")).max() < 1e-9


def test_each_rank_gets_its_share_of_the_cores(tmp_path):
    """Unbound ranks (the launcher's way) split the host's cores; a rank bound to one core gets one thread."""
    cores = len(os.sched_getaffinity(0))
    options = [*KSVD, "--iterations", "5"]
    for ranks in (1, 2):
        assert_ok(dictlearn(ranks, tmp_path / f"unbound-{ranks}.h5", *options))
        with h5py.File(tmp_path / f"unbound-{ranks}.h5", "r") as file:
            assert file.attrs["numba_threads_per_rank"] == max(1, cores // ranks), (ranks, cores)
    environment = {**SESSION_ENVIRONMENT, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    command = [sys.executable, "-m", "mpiscale.cli", "dictlearn", "--out", str(tmp_path / "bound.h5"), *options]
    bound = subprocess.run(["mpirun", "-q", "-n", "2", "--bind-to", "core", *command], env=environment, cwd=REPO,
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bound.returncode == 0, bound.stdout + bound.stderr
    with h5py.File(tmp_path / "bound.h5", "r") as file:
        assert file.attrs["numba_threads_per_rank"] == 1


def test_one_rank_is_one_rank_in_what_the_job_and_inspect_say(tmp_path):
    """'on 1 rank', never 'on 1 ranks': the job's last line, its telemetry's start, and inspect."""
    out = tmp_path / "one.h5"
    job = dictlearn(1, out, *KSVD, "--iterations", "5")
    assert_ok(job)
    assert "5 iterations on 1 rank" in job.stdout and "1 ranks" not in job.output, job.output[-2000:]
    shown = subprocess.run([sys.executable, "-m", "mpiscale.cli", "inspect", str(out)], capture_output=True, text=True,
                           timeout=120)  # fmt: skip
    assert shown.returncode == 0 and "on 1 rank (" in shown.stdout and "1 ranks" not in shown.stdout, shown.stdout
    telemetry = Path(f"{out}.telemetry.jsonl").read_text()
    assert "on 1 rank" in telemetry and "1 ranks" not in telemetry


@pytest.mark.parametrize("scale", [0.0, 1e-160, 1e160], ids=["zero", "denormal-squares", "overflowing-squares"])
def test_data_that_cannot_teach_is_refused_in_one_line(tmp_path, scale):
    """All-zero data (it ran to 'error 0.0000' and a random dictionary), and data whose squares leave float64's
    normal range (at 1e-160 every code was zero and atoms came out of norm 1.2): refused on both ranks, status 2."""
    signals = np.random.default_rng(0).standard_normal((400, 16)) * scale
    path = tmp_path / "signals.npy"
    np.save(path, signals)
    job = dictlearn(2, tmp_path / "d.h5", "--data", str(path), "--atoms", "8", "--sparsity", "2", "--iterations", "3")
    assert job.returncode == 2 and job.stderr.count("\n") == 1, job.output[-3000:]
    expected = "every value is zero" if scale == 0 else "scale the data first"
    assert expected in job.stderr and not (tmp_path / "d.h5").exists(), job.stderr


def test_a_refused_run_writes_no_telemetry_and_leaves_the_earlier_runs_record_whole(tmp_path):
    """A refusal used to leave OUT.telemetry.jsonl behind, and a refused re-run appended a 'failed' status to the
    earlier good run's file (watch then showed that run as failed, exit 1); a missing --out folder printed a
    telemetry WARNING before the refusal."""
    out = tmp_path / "run.h5"
    missing = dictlearn(2, tmp_path / "no-such-folder" / "run.h5", *KSVD, "--iterations", "5")
    assert missing.returncode == 2 and "WARNING" not in missing.output and "telemetry" not in missing.output, (
        missing.output[-2000:]
    )
    assert missing.stderr.strip().count("\n") == 0, missing.stderr  # the refusal, one line
    refused = dictlearn(2, out, "--data", str(tmp_path / "absent.h5:/X"), "--iterations", "5")
    assert refused.returncode == 2 and not Path(f"{out}.telemetry.jsonl").exists(), sorted(tmp_path.iterdir())
    assert_ok(dictlearn(2, out, *KSVD, "--iterations", "5"))
    telemetry = Path(f"{out}.telemetry.jsonl")
    good = telemetry.read_bytes()
    again = dictlearn(2, out, *KSVD, "--iterations", "5", "--atoms", "5000")  # more atoms than signals: refused
    assert again.returncode == 2 and "5000 atoms need at least as many signals" in again.stderr, again.output[-2000:]
    assert telemetry.read_bytes() == good
    shown = subprocess.run([sys.executable, "-m", "mpiscale.cli", "watch", "--file", str(telemetry)],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert shown.returncode == 0 and "finished" in shown.stdout and "failed" not in shown.stdout, shown.stdout


def test_atoms_left_as_near_duplicates_are_named_by_the_run_and_by_inspect(tmp_path):
    """20 distinct signals, repeated, and 32 atoms: every signal is coded exactly, so no residual is left to replace
    duplicate atoms with, and pairs at |cos| 1.000 stayed despite --duplicate-cosine 0.99 without a word."""
    rng = np.random.default_rng(0)
    distinct = rng.standard_normal((20, 64))
    np.save(tmp_path / "twenty.npy", distinct[rng.integers(0, 20, 2000)])
    out = tmp_path / "twenty.h5"
    job = dictlearn(2, out, "--data", str(tmp_path / "twenty.npy"), "--atoms", "32", "--sparsity", "4",
                    "--iterations", "60")  # fmt: skip
    assert_ok(job)
    dictionary = learned(out)
    cosines = np.abs(dictionary @ dictionary.T)[np.triu_indices(32, 1)]
    pairs = int((cosines > 0.99).sum())
    assert pairs > 0  # the data cannot give 32 distinct atoms
    assert f"note: {pairs} pairs of atoms remain at |cosine| above --duplicate-cosine 0.99" in job.stdout, job.stdout
    shown = subprocess.run([sys.executable, "-m", "mpiscale.cli", "inspect", str(out)], capture_output=True, text=True,
                           timeout=120)  # fmt: skip
    assert f"atoms closer than |cos| 0.99: {pairs} pairs (the closest two at 1.000)" in shown.stdout, shown.stdout


def test_the_plots_show_the_final_recovery_the_worst_atoms_and_one_unit_per_axis(tmp_path):
    """Without --eval-every the recovery panel was empty though the file keeps the final rate; the planted-atom panel
    showed the first 6 atoms (all at |cos| 1.000), not the worst; the usage panel put a % and a count on one axis."""
    from mpiscale.dictlearn.results import figure

    out = tmp_path / "planted.h5"
    assert_ok(dictlearn(2, out, *KSVD, "--iterations", "20"))
    _, recovery, atoms = figure(str(out)).axes
    with h5py.File(out, "r") as file:
        final = float(file.attrs["recovery_rate"])
    assert [line.get_label() for line in recovery.get_lines()] == [f"at the end: {final:.0%}"] and not recovery.texts
    shown = [float(text.get_text().rsplit(" ", 1)[1]) for text in atoms.texts]
    assert len(shown) == 6 and shown == sorted(shown) and "recovered worst" in atoms.get_title(), atoms.get_title()
    assert f"{sum(cos <= 0.99 for cos in shown)} of 50 missed" in atoms.get_title() or shown[-1] <= 0.99
    np.save(tmp_path / "patches.npy", np.random.default_rng(0).standard_normal((600, 16)))  # 4x4: an image grid
    real = tmp_path / "real.h5"
    assert_ok(dictlearn(2, real, "--data", str(tmp_path / "patches.npy"), "--atoms", "12", "--iterations", "20"))
    _, usage, grid, replaced = figure(str(real)).axes
    assert usage.get_ylabel() == "% of the atoms unused by the batch"
    assert replaced.get_ylabel() == "atoms replaced so far" and grid.get_title() == "the 12 learned atoms"
    rgb = np.random.default_rng(1).random((600, 4, 4, 3))  # colour patches, channels last and first: no grid before
    for layout, patches in (("last", rgb), ("first", rgb.transpose(0, 3, 1, 2))):
        np.save(tmp_path / f"{layout}.npy", patches)
        out = tmp_path / f"colour-{layout}.h5"
        assert_ok(dictlearn(2, out, "--data", str(tmp_path / f"{layout}.npy"), "--atoms", "9", "--iterations", "5"))
        grid = figure(str(out)).axes[2]
        assert grid.get_title() == "the 9 learned atoms" and grid.get_images()[0].get_array().shape == (16, 16, 3)


def test_a_refused_run_leaves_the_earlier_runs_synthetic_set_as_it_was(tmp_path):
    """The planted set was written before the checkpoint and size checks: a refused --resume with other atoms (so
    another planted set) rewrote OUT.synthetic.h5 under the earlier run's checkpoints."""
    out = tmp_path / "planted.h5"
    assert_ok(dictlearn(2, out, *KSVD, "--iterations", "20", "--checkpoint-every", "10"))
    synthetic = tmp_path / "planted.synthetic.h5"
    before = synthetic.read_bytes()
    with h5py.File(synthetic, "r") as file:
        signals = file["signals"][()]
    for options, message in ((["--atoms", "40", "--resume"], "belongs to another job"),
                             (["--atoms", "2000"], "2000 atoms need at least as many signals")):  # fmt: skip
        job = dictlearn(2, out, *KSVD, "--iterations", "20", "--checkpoint-every", "10", *options)
        assert job.returncode == 2 and message in job.stderr, job.output[-2000:]
        assert synthetic.read_bytes() == before
    resumed = dictlearn(2, out, *KSVD, "--iterations", "30", "--checkpoint-every", "10", "--resume")
    assert_ok(resumed)
    with h5py.File(synthetic, "r") as file:  # a run that goes on writes the same set again (its time stamp aside)
        assert np.array_equal(file["signals"][()], signals) and file_rate(out) > 0
