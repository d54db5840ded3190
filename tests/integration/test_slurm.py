"""The project's own sbatch templates on a real single-node Slurm: plain runs of every template, the time-limit
signal (checkpoint, requeue, resume), a killed rank (requeue, resume), a resubmission on another task count, and
an oversized request refused. Results are compared with an uninterrupted run of the same template."""

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from helpers import PROGRAMS, REPO
from slurm_cluster import SubmitError

from mpiscale.adapters.planted import write_planted
from mpiscale.circuits.store import ModelRef, NewCircuits, add_circuits

TEMPLATES = REPO / "hpc" / "slurm"
ITERATIONS = 6000  # 3-5 s on 2 ranks (checkpoints every 500): time to signal or kill a run in the middle
DICTLEARN = {
    "MPISCALE_HOME": str(REPO),
    "ATOMS": "50",
    "ITERATIONS": str(ITERATIONS),
    "CHECKPOINT_EVERY": "500",
    "OPTIONS": "--samples 1500 --features 20 --sparsity 3 --snr-db 20 --progress-every 0",
    "MPISCALE_TELEMETRY_INTERVAL_S": "0.5",
}
# mpirun inside the allocation: the launcher sets mpirun's wait before it kills stopped ranks (and again before it
# exits) to half of KillWait, 14 s here. The ranks of these runs checkpoint in a tenth of a second, so the tests
# set the wait a site may set itself, 3 s, and save the rest.
MPIRUN = {"MPISCALE_LAUNCHER": "mpirun", "OMPI_MCA_odls_base_sigkill_timeout": "3"}


def dictlearn(slurm, run: Path, *options: str, **settings: str) -> str:
    """Submit hpc/slurm/dictlearn.sbatch (2 tasks unless ``options`` say otherwise) writing to ``run``."""
    env = {**DICTLEARN, "RUN": str(run), **settings}
    return slurm.submit(TEMPLATES / "dictlearn.sbatch", "--ntasks=2", *options, cwd=run.parent, env=env)


def output(run: Path, job: str, name: str = "mpiscale-dictlearn") -> str:
    return (run.parent / f"{name}-{job}.out").read_text()


def learned(run: Path) -> tuple[np.ndarray, dict]:
    with h5py.File(run / "dictionary.h5", "r") as file:
        return file["dictionary"][()], dict(file.attrs)


def checkpointed(run: Path) -> int:
    latest = run / "checkpoints" / "latest"
    return int(latest.read_text()) if latest.exists() else 0


def wait_for_checkpoint(slurm, job: str, run: Path, step: int, timeout: float = 120) -> None:
    slurm.wait(job, timeout, until=lambda j: checkpointed(run) >= step or j.state not in ("PENDING", "RUNNING"))
    assert checkpointed(run) >= step, f"job {job} ended before its checkpoint of iteration {step}"


def done(slurm, job: str, timeout: float = 180):
    finished = slurm.wait(job, timeout)
    assert finished.state == "COMPLETED" and finished.exit_code == "0:0", finished.fields
    return finished


@pytest.fixture(scope="module")
def uninterrupted(slurm, tmp_path_factory):
    """A plain run of the dictlearn template: its job id, run directory and dictionary."""
    run = tmp_path_factory.mktemp("plain") / "run"
    job = dictlearn(slurm, run)
    done(slurm, job)
    return job, run, learned(run)[0]


def test_the_encode_template_codes_the_data_with_the_templates_dictionary(slurm, uninterrupted, tmp_path):
    """hpc/slurm/encode.sbatch after the dictlearn template: the planted signals coded with its dictionary, equal to
    one process's codes."""
    from mpiscale.dictlearn import load_codes, omp_encode

    _, run, dictionary = uninterrupted
    env = {"MPISCALE_HOME": str(REPO), "DICTIONARY": str(run / "dictionary.h5"),
           "DATA": f"{run}/dictionary.synthetic.h5:/signals", "OUT": str(tmp_path / "codes.h5"),
           "OPTIONS": "--batch-size 100 --progress-every 0"}  # fmt: skip
    job = slurm.submit(TEMPLATES / "encode.sbatch", "--ntasks=2", cwd=tmp_path, env=env)
    done(slurm, job)
    text = (tmp_path / f"mpiscale-encode-{job}.out").read_text()
    assert f"wrote {tmp_path}/codes.h5: codes of 1,500 signals over 50 atoms" in text, text
    with h5py.File(run / "dictionary.synthetic.h5", "r") as file:
        signals = file["signals"][()]
    codes = load_codes(str(tmp_path / "codes.h5")).to_scipy().toarray()
    assert np.abs(codes - omp_encode(signals, dictionary, 3)).max() < 1e-12


def test_a_plain_run_of_the_dictlearn_template(slurm, uninterrupted):
    job, run, dictionary = uninterrupted
    text = output(run, job)
    assert f"wrote {run}/dictionary.h5: {ITERATIONS} iterations on 2 ranks" in text
    _, attrs = learned(run)
    assert attrs["stop_reason"] == "iterations" and attrs["world_size"] == 2 and dictionary.shape[0] == 50
    records = [json.loads(line) for line in (run / "dictionary.h5.telemetry.jsonl").read_text().splitlines()]
    assert {record["job"] for record in records} == {job}  # the telemetry job id is Slurm's
    assert records[-1]["kind"] == "status" and records[-1]["state"] == "finished"


# Under mpirun the same signal, requeue and resume run in make test-slow; make test stops and resumes an mpirun line
# (test_a_plain_scancel_under_mpirun_...) and requeues an srun one.
@pytest.mark.parametrize("launcher", ["srun", pytest.param("mpirun", marks=pytest.mark.slow)])
def test_the_time_limit_signal_checkpoints_requeues_and_the_job_resumes(slurm, uninterrupted, tmp_path, launcher):
    """What --signal=B:USR1@120 does before the limit (here sent by hand to a job without a time limit: the same
    signal to the batch shell), with either launcher line inside the allocation."""
    run = tmp_path / "run"
    job = dictlearn(
        slurm, run, "--time=UNLIMITED", **(MPIRUN if launcher == "mpirun" else {"MPISCALE_LAUNCHER": "srun"})
    )
    wait_for_checkpoint(slurm, job, run, 500)
    slurm.run(["scancel", "--signal=USR1", "--batch", job])
    finished = done(slurm, job)
    assert finished.restarts == 1
    text = output(run, job)
    assert "the time limit is near: every rank stops after its step with a checkpoint" in text
    assert f"mpiscale-run: {launcher} " in text  # the launcher line that ran
    stopped = int(text.split("stopped on request (a stop command or SIGTERM) after iteration ")[1].split(";")[0])
    assert f"the time limit is near: requeueing job {job} (requeue 1 of 5)" in text
    assert f"resumed from the checkpoint of iteration {stopped} in {run}/checkpoints" in text
    dictionary, attrs = learned(run)
    assert attrs["iterations"] == ITERATIONS and attrs["stop_reason"] == "iterations"
    assert np.abs(dictionary - uninterrupted[2]).max() < 1e-9
    records = [json.loads(line) for line in (run / "dictionary.h5.telemetry.jsonl").read_text().splitlines()]
    states = [r["state"] for r in records if r["kind"] == "status"]
    assert states == ["running", "stopped", "running", "finished"], states
    assert any(r["kind"] == "event" and r["event"] == "restarted" and r["job"] == job for r in records)


def test_a_killed_rank_ends_the_run_at_once_and_the_requeued_job_resumes(slurm, uninterrupted, tmp_path):
    """srun ends the step of a rank killed by SIGKILL with SIGTERM to the other, then SIGKILL only KillWait (30 s,
    Slurm's default here) later: the other sees the dead rank of its host and ends the run within seconds, or, held
    in its background checkpoint's parallel HDF5 open that waits for the dead rank, the death watch kills it."""
    run = tmp_path / "run"
    job = dictlearn(slurm, run)
    wait_for_checkpoint(slurm, job, run, 1000)
    ranks = [pid for pid, command in _processes() if "python" in command.split(" ")[0]
             and "mpiscale dictlearn" in command and str(run) in command]  # fmt: skip
    assert len(ranks) == 2, ranks
    os.kill(max(ranks), signal.SIGKILL)
    killed = time.monotonic()
    slurm.wait(job, 60, until=lambda j: j.restarts == 1)
    assert time.monotonic() - killed < 15, "the run outlived its killed rank"  # KillWait is 30 s
    finished = done(slurm, job)
    text = output(run, job)
    assert f" (pid {max(ranks)}) on host " in text and "ended while the job ran (killed by a signal" in text, text
    held = "still ran 5 s after that death, held" in text  # then srun's status is the held rank's SIGKILL
    assert f"the job failed (status {137 if held else 1}): requeueing job {job} (requeue 1 of 5)" in text, text
    assert "resumed from the checkpoint of iteration " in text and finished.restarts == 1
    dictionary, attrs = learned(run)
    assert attrs["iterations"] == ITERATIONS and np.abs(dictionary - uninterrupted[2]).max() < 1e-9


def test_a_rank_killed_beside_a_rank_held_in_native_code_ends_the_step_long_before_killwait(slurm, tmp_path):
    """Rank 1 is SIGKILLed while rank 0's Python is held in native code that keeps the GIL, as h5py does in a
    background checkpoint's parallel HDF5 open that waits for the dead rank: srun's SIGTERM cannot reach its Python,
    and the step ended only KillWait (30 s) later (the killed-rank test above, 1 CI run in about 30; 1 kill in 8 of
    a run that checkpoints every 40 iterations). The host's death watch names rank 1, then kills rank 0 HELD_S
    after the death."""
    script = tmp_path / "held.sbatch"
    program = f"{sys.executable} {PROGRAMS / 'failures.py'} killed-beside-a-held-rank {tmp_path / 'rows.h5'}"
    script.write_text(f'#!/bin/bash\nexec "$MPISCALE_HOME/launch/mpiscale-run" -n 2 -- {program}\n')
    environment = {"MPISCALE_HOME": str(REPO), "MPISCALE_LAUNCHER": "srun", "MPISCALE_TELEMETRY": "0"}
    job = slurm.submit(script, "--ntasks=2", "--no-requeue", cwd=tmp_path, env=environment)
    log = tmp_path / f"slurm-{job}.out"
    slurm.wait(job, 120, until=lambda j: log.exists() and "rank 1 kills itself" in log.read_text())
    killed = time.monotonic()
    ended = slurm.wait(job, 60)
    assert time.monotonic() - killed < 20, "the held rank outlived the killed one"  # KillWait is 30 s
    assert ended.state == "FAILED", ended.fields
    text = log.read_text()
    for line in (r"rank 1 \(pid \d+\) on host \S+ ended while the job ran",
                 r"rank 0 \(pid \d+\) on host \S+ still ran 5 s after that death, held"):  # fmt: skip
        assert re.search(f"^mpiscale: {line}", text, re.M), text


def test_a_plain_scancel_under_mpirun_stops_with_a_checkpoint_and_resumes(slurm, uninterrupted, tmp_path):
    """Slurm's cancel signals mpirun as well as the ranks; mpirun used to kill them a second later. Now they stop
    after their step with a checkpoint, and a resubmission resumes from it to the uninterrupted run's dictionary."""
    run = tmp_path / "run"
    job = dictlearn(slurm, run, **MPIRUN)
    wait_for_checkpoint(slurm, job, run, 500)
    slurm.run(["scancel", job])
    stopped = slurm.wait(job, 60)
    assert stopped.state == "CANCELLED" and stopped.restarts == 0, stopped.fields
    records = [json.loads(line) for line in (run / "dictionary.h5.telemetry.jsonl").read_text().splitlines()]
    assert records[-1]["kind"] == "status" and records[-1]["state"] == "stopped", records[-3:]
    detail = records[-2]["detail"]  # mpirun drops what the ranks print after its SIGTERM: telemetry says it
    assert detail.startswith("dictlearn stopped after iteration ") and detail.endswith(", its state saved"), detail
    step = int(detail.split("iteration ")[1].split(",")[0])
    assert checkpointed(run) == step
    second = dictlearn(slurm, run)
    done(slurm, second)
    assert f"resumed from the checkpoint of iteration {step}" in output(run, second)
    assert np.abs(learned(run)[0] - uninterrupted[2]).max() < 1e-9


def test_a_job_out_of_requeues_runs_on_and_a_scancel_resumes_on_another_task_count(slurm, uninterrupted, tmp_path):
    """REQUEUES=0: the time-limit signal neither stops nor requeues the last run; a plain scancel (what the time
    limit itself sends too) stops it with a checkpoint, and the template submitted with 3 tasks resumes it
    resharded to the uninterrupted run's dictionary."""
    run = tmp_path / "run"
    first = dictlearn(slurm, run, REQUEUES="0")
    wait_for_checkpoint(slurm, first, run, 500)
    slurm.run(["scancel", "--signal=USR1", "--batch", first])
    slurm.wait(first, 60, until=lambda j: "it runs on to its limit" in output(run, first) or j.state != "RUNNING")
    assert "the job was requeued 0 times already (--requeue 0): it runs on to its limit" in output(run, first)
    slurm.run(["scancel", first])
    stopped = slurm.wait(first, 120)
    assert stopped.restarts == 0 and stopped.state == "CANCELLED", stopped.fields
    text = output(run, first)
    step = int(text.split("stopped on request (a stop command or SIGTERM) after iteration ")[1].split(";")[0])
    assert step < ITERATIONS and checkpointed(run) == step and "requeueing" not in text
    second = dictlearn(slurm, run, "--ntasks=3")
    done(slurm, second)
    text = output(run, second)
    assert f"resumed from the checkpoint of iteration {step}" in text and "iterations on 3 ranks" in text
    assert np.abs(learned(run)[0] - uninterrupted[2]).max() < 1e-9


def test_a_sigterm_sent_to_the_ranks_stops_the_job_and_is_not_requeued(slurm, tmp_path):
    """scancel --signal=TERM signals the ranks, not the batch shell: they stop with a checkpoint (status 143),
    which is a cancel, not a failure to requeue."""
    run = tmp_path / "run"
    job = dictlearn(slurm, run)
    wait_for_checkpoint(slurm, job, run, 500)
    slurm.run(["scancel", "--signal=TERM", job])
    stopped = slurm.wait(job, 120)
    assert stopped.restarts == 0 and stopped.state == "FAILED" and stopped.exit_code == "143:0", stopped.fields
    text = output(run, job)
    assert "the ranks were stopped by SIGTERM (status 143), sent to them directly: not restarted nor requeued" in text
    step = int(text.split("stopped on request (a stop command or SIGTERM) after iteration ")[1].split(";")[0])
    assert step < ITERATIONS and checkpointed(run) == step and "requeueing" not in text


def test_a_time_limit_signal_as_early_as_the_start_is_not_requeued(slurm, tmp_path):
    """The template's lead (--signal=B:USR1@120) with --time=4: half the limit or more, so a requeued run would
    stop as it starts. Signalled by hand as soon as a checkpoint is there, the launcher warns and the run goes on
    to its end. Slurm's own signal comes 120 s after the start, when (left >= ran) it is warned of alike. With
    --time=1 it came within the first minute, and a run slowed by two busy loops beside it was still going then
    (at step 5,459 of 6,000): a second signal, past half the limit, rightly requeued."""
    run = tmp_path / "run"
    job = dictlearn(slurm, run, "--time=4")
    wait_for_checkpoint(slurm, job, run, 500)
    slurm.run(["scancel", "--signal=USR1", "--batch", job])
    finished = done(slurm, job)
    assert finished.restarts == 0
    text = output(run, job)
    assert "WARNING: the time limit is near " in text and "Give the job a longer --time, or a shorter lead." in text
    assert "every rank stops after its step" not in text and "requeueing" not in text
    _, attrs = learned(run)
    assert attrs["iterations"] == ITERATIONS and attrs["stop_reason"] == "iterations"


def test_the_train_collect_memstore_circuits_and_compress_adapters_templates_run(slurm, tmp_path):
    """Each with small settings: pipeline training on the bundled digits, signalled as before its time limit,
    requeued and resumed; collect of its activations; a small memory store; a module's circuits on its data; six
    adapters compressed."""
    common = {"MPISCALE_TELEMETRY_INTERVAL_S": "0.5"}
    # Where mpiscale is, three ways: MPISCALE_HOME (train); the checkout of the mpiscale on PATH (memstore, from a
    # copy of its template); neither, so the checkout the template was submitted from (collect).
    train = slurm.submit(TEMPLATES / "train.sbatch", "--ntasks=2", "--time=UNLIMITED", cwd=tmp_path,
                         env={**common, "MPISCALE_HOME": str(REPO), "RUN": "train", "EPOCHS": "30",
                              "CHECKPOINT_EVERY": "40",
                              "OPTIONS": "--stages 2 --micro-batches 4 --progress-every 0"})  # fmt: skip
    bare_path = ":".join(part for part in os.environ["PATH"].split(":") if ".venv" not in part)
    copy = tmp_path / "my-memstore.sbatch"
    copy.write_text((TEMPLATES / "memstore.sbatch").read_text())
    venv_path = f"{REPO}/.venv/bin:{bare_path}"
    store = slurm.submit(copy, "--nodes=1", "--ntasks=2", cwd=tmp_path,
                         env={**common, "PATH": venv_path, "RUN": "store", "RECORDS": "20000", "ITERATIONS": "50",
                              "CHECKPOINT_EVERY": "10", "LOCAL": str(tmp_path / "local")})  # fmt: skip
    wait_for_checkpoint(slurm, train, tmp_path / "train", 40)
    slurm.run(["scancel", "--signal=USR1", "--batch", train])
    assert done(slurm, train).restarts == 1
    text = output(tmp_path / "train", train, "mpiscale-train")
    assert f"the time limit is near: requeueing job {train} (requeue 1 of 5)" in text
    assert "resumed from the checkpoint of step " in text
    with h5py.File(tmp_path / "train" / "model.h5", "r") as model:
        assert model.attrs["world_size"] == 2 and model.attrs["steps"] == 30 * (1437 // 64)
        assert json.loads(model.attrs["config"])["stages"] == 2
    collect = slurm.submit(TEMPLATES / "collect.sbatch", "--ntasks=2", cwd=tmp_path,
                           env={**common, "PATH": bare_path, "MODEL": "train/model.h5", "OUT": "acts.h5"})  # fmt: skip
    done(slurm, collect)
    with h5py.File(tmp_path / "acts.h5", "r") as acts:
        assert (
            acts["sample_ids"].shape[0] > 1000 and (acts["sample_ids"][()] == np.arange(len(acts["sample_ids"]))).all()
        )
    done(slurm, store)
    assert "wrote store/store.h5" in output(tmp_path / "store", store, "mpiscale-memstore")
    # circuits run over the trained model's data: a user's exported module in a catalogue
    module = torch.nn.Sequential(torch.nn.Linear(64, 3), torch.nn.Tanh()).eval()
    program = torch.export.export(module, (torch.zeros(2, 64),), dynamic_shapes=({0: torch.export.Dim("b", min=1)},))
    torch.export.save(program, tmp_path / "tanh.pt2")
    model = ModelRef.of(str(tmp_path / "tanh.pt2"), "export", 64, "float32")
    add_circuits(str(tmp_path / "cat.h5"), NewCircuits(model, "", ["a", "b", "c"], np.eye(3), "test"))
    circuits = slurm.submit(TEMPLATES / "circuits-run.sbatch", "--ntasks=2", cwd=tmp_path,
                            env={**common, "MPISCALE_HOME": str(REPO), "CATALOGUE": "cat.h5",
                                 "DATA": "train/model.digits.h5:/inputs", "OUT": "f/features.h5"})  # fmt: skip
    done(slurm, circuits)
    with h5py.File(tmp_path / "train" / "model.digits.h5", "r") as digits, torch.no_grad():
        expected = module(torch.from_numpy(digits["inputs"][()])).numpy()
    with h5py.File(tmp_path / "f" / "features.h5", "r") as features:
        np.testing.assert_allclose(features["features"][()], expected, rtol=1e-5, atol=1e-6)

    write_planted(tmp_path / "adapters", 6)
    compress = slurm.submit(TEMPLATES / "compress-adapters.sbatch", "--ntasks=2", cwd=tmp_path,
                            env={**common, "MPISCALE_HOME": str(REPO), "ADAPTERS": "adapters", "OUT": "c/adapters.h5",
                                 "OPTIONS": "--components 4"})  # fmt: skip
    done(slurm, compress)
    with h5py.File(tmp_path / "c" / "adapters.h5", "r") as compressed:
        assert compressed.attrs["world_size"] == 2 and compressed["groups/0000/A/loadings"].shape == (6, 4, 4)


def test_an_oversized_request_is_refused_with_slurms_reason(slurm, tmp_path):
    refusals = "More processors requested than permitted|Requested node configuration is not available"
    with pytest.raises(SubmitError, match=refusals):
        dictlearn(slurm, tmp_path / "run", "--ntasks=64")


#: What rank 0 says, once, of an srun whose tasks cannot form one MPI job, by its MPI plugin.
UNJOINABLE = {
    "none": "srun started 2 tasks without an MPI plugin (srun --mpi=none, or the site's MpiDefault)",
    "pmi2": "srun started 2 tasks with Slurm's PMI-2 plugin (srun --mpi=pmi2, or the site's MpiDefault), and Open MPI",
}


@pytest.mark.parametrize("plugin", ["none", "pmi2", "pmix"])
def test_srun_without_an_mpi_plugin_open_mpi_speaks_is_refused_in_one_line_before_mpi_starts(slurm, tmp_path,
                                                                                              plugin):  # fmt: skip
    """srun --mpi=none (many sites' MpiDefault) started tasks that could not find each other, and --mpi=pmi2 tasks
    that this Open MPI (PMIx alone, as Debian builds it) cannot start with: Open MPI ended each in MPI_Init with a
    banner per task, blaming how it was built ("OMPI was not built with SLURM's PMI support")."""
    command = ["srun", "--ntasks=2", f"--mpi={plugin}", sys.executable, "-m", "mpiscale.cli", "dictlearn",
               "--atoms", "8", "--samples", "400", "--iterations", "5", "--out", str(tmp_path / "d.h5")]  # fmt: skip
    ran = slurm.run(command, check=False, timeout=120, cwd=tmp_path)
    if plugin == "pmix":
        assert ran.returncode == 0 and "on 2 ranks" in ran.stdout, ran.stdout + ran.stderr
        return
    assert ran.returncode == 2 and ran.stderr.count(UNJOINABLE[plugin]) == 1, ran.stderr
    assert "run srun --mpi=pmix (what Open MPI speaks" in ran.stderr
    assert "MPI_Init" not in ran.stderr and not (tmp_path / "d.h5").exists()


# A user's own programs, as the guide writes them: actors under mpiscale.run, and the estimator in a plain script.
USER_PROGRAMS = {
    "run": "import mpiscale\n\nasync def main(system):\n    print('rank', system.rank, 'of', system.size)\n\n"
    "mpiscale.run(main)\n",
    "estimator": "import numpy as np\nfrom mpiscale.dictlearn import DictionaryLearning\n\n"
    "X = np.random.default_rng(0).standard_normal((200, 8))\n"
    "print('learned', DictionaryLearning(n_components=4, max_iter=3).fit(X).components_.shape)\n",
}


@pytest.mark.parametrize("program", sorted(USER_PROGRAMS))
@pytest.mark.parametrize("plugin", ["none", "pmi2", "pmix"])
def test_a_python_program_under_srun_without_an_mpi_plugin_says_so_before_mpi_starts(slurm, tmp_path, plugin,
                                                                                       program):  # fmt: skip
    """The command line's refusal, for users' own programs: mpiscale.run says it once (status 2, as the command
    line), the estimator raises LaunchError on every task (a library call); Open MPI's banner ended each task."""
    script = tmp_path / f"{program}.py"
    script.write_text(USER_PROGRAMS[program])
    ran = slurm.run(["srun", "--ntasks=2", f"--mpi={plugin}", sys.executable, str(script)], check=False, timeout=120,
                    cwd=tmp_path)  # fmt: skip
    if plugin == "pmix":
        expected = "rank 1 of 2" if program == "run" else "learned (4, 8)"
        assert ran.returncode == 0 and expected in ran.stdout, ran.stdout + ran.stderr
        return
    said = UNJOINABLE[plugin]
    assert ran.returncode != 0 and "MPI_Init" not in ran.stderr, ran.stderr
    if program == "run":
        assert ran.returncode == 2 and ran.stderr.count(said) == 1 and "Traceback" not in ran.stderr, ran.stderr
    else:
        assert ran.stderr.count(f"LaunchError: {said}") == 2, ran.stderr


def _processes():
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            yield int(entry.name), command


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_slurms_own_time_limit_signal_requeues_a_job_longer_than_the_lead(slurm, tmp_path):
    """The template as it is (--signal=B:USR1@120), a real --time=6, Slurm's default KillWait, and a job far longer
    than the lead: Slurm itself signals the batch shell 120-150 s before the limit (it checks every 30 s and sends
    early rather than late), every rank checkpoints, the job is requeued and resumes; a plain scancel then stops
    the resumed run with a checkpoint, with no SIGKILL anywhere. About four minutes: ``make test-slow``."""
    run = tmp_path / "run"
    job = dictlearn(slurm, run, "--time=6", ITERATIONS="100000000", CHECKPOINT_EVERY="50000")
    started = time.monotonic()
    slurm.wait(job, 60, until=lambda j: j.state == "RUNNING")
    requeued = slurm.wait(job, 400, until=lambda j: j.restarts == 1)
    ran = time.monotonic() - started
    assert 6 * 60 - 180 <= ran <= 6 * 60 - 120 + 30, f"requeued {ran:.0f} s after the start"
    print(f"job {job}: requeued {ran:.0f} s after it started")
    slurm.wait(job, 120, until=lambda j: "resumed from the checkpoint of iteration " in output(run, job))
    text = output(run, job)
    assert "the time limit is near: every rank stops after its step with a checkpoint" in text
    assert "mpiscale-run: WARNING" not in text
    assert f"the time limit is near: requeueing job {job} (requeue 1 of 5)" in text
    stopped = int(text.split("stopped on request (a stop command or SIGTERM) after iteration ")[1].split(";")[0])
    assert stopped > 50000 and f"resumed from the checkpoint of iteration {stopped} in {run}/checkpoints" in text
    slurm.run(["scancel", job])
    cancelled = slurm.wait(job, 120)
    assert cancelled.state == "CANCELLED" and cancelled.restarts == 1, (requeued.fields, cancelled.fields)
    text = output(run, job)
    last = int(text.split("stopped on request (a stop command or SIGTERM) after iteration ")[-1].split(";")[0])
    assert last > stopped and checkpointed(run) == last and "SIGKILL" not in text and "killed by" not in text, text
    records = [json.loads(line) for line in (run / "dictionary.h5.telemetry.jsonl").read_text().splitlines()]
    states = [r["state"] for r in records if r["kind"] == "status"]
    assert states == ["running", "stopped", "running", "stopped"], states
