"""A job's start and outputs: checks agreed by every rank, output directories, the results lock, the checkpointer,
and the results file written with the ranks' agreement."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

import h5py

from ..io import (
    Checkpointer,
    CheckpointError,
    DataFileError,
    LockedError,
    OutputLock,
    WriteError,
    file_format,
    not_found,
    resolve_files,
    same_file,
    split_spec,
    write_file,
)
from ..ranks import Comm, agree
from ..runtime import ActorSystem, JobRefused
from ..telemetry import current
from .registry import job_of_results
from .settings import option

Job = TypeVar("Job")


async def start_agreed(
    system: ActorSystem, command: str, prepare: Callable[[], Job], give_up: Callable[[Job], None]
) -> Job:
    """``prepare()`` on every rank, then agree: bad input ends every rank with one message and status 2.

    Bad input is a ``ValueError`` (data, settings, paths; ``DataFileError`` is
    one), a ``CheckpointError`` or a ``LockedError`` (another job on the same
    outputs). A ``WriteError`` (a file the job writes first did not fit) ends
    it with status 1: the run failed, the input was fine. A rank whose own
    ``prepare`` passed while another's failed gives back what it claimed
    (``give_up(job)``: rank 0's results lock, say), so a refusal found on one
    rank alone leaves no lock file behind either.
    """
    job: Job | None = None
    status, prepared = 2, False
    problem: Exception | None = None
    try:
        job, prepared = prepare(), True
    except (ValueError, CheckpointError, LockedError) as error:
        problem = ValueError(f"mpiscale {command}: {error}")
    except WriteError as error:
        problem, status = OSError(f"mpiscale {command}: {error}"), 1
    try:
        await system.agree(problem, "the input and settings", status=status)
    except JobRefused:
        if prepared:
            give_up(job)  # type: ignore[arg-type]  # prepared: the job was made
        raise
    assert prepared  # the agreement raised on every rank otherwise
    session = current()
    if session is not None:
        session.accept()
    return job  # type: ignore[return-value]


def claim_outputs(out: str, checkpoints: str | None, inputs: Iterable[str], comm: Comm, kind: str) -> OutputLock | None:
    """The job's outputs checked and claimed before anything is written (collective): ``out`` and the checkpoint
    directory (None: not used) writable, ``out`` none of the data specs ``inputs`` (empty ones are skipped) and no
    file but an earlier results file of the job (``kind``: its format), and ``out``'s lock taken so that a second
    job on the same outputs stops here.

    Returns the lock on rank 0 (release it when the job ends), None elsewhere. Raises ValueError (or
    LockedError) on every rank.
    """
    check_outputs(out, checkpoints)  # every rank sees the same file system, and so the same answer
    check_not_an_input(out, [spec for spec in inputs if spec], comm)
    check_replaceable(out, kind, comm)
    return lock_results(out, comm)


def check_replaceable(path: str, kind: str, comm: Comm, what: str = "the results file") -> None:
    """Raise ValueError on every rank if ``path`` exists and is not a file of ``kind`` (an mpiscale format, any
    version) (collective; rank 0 looks): a user's data or another job's results, which writing there would replace
    without a word. An earlier run's results are replaced, as a rerun means."""
    problem = _replaced(path, kind) if comm.Get_rank() == 0 else None
    problem = comm.bcast(problem, 0)
    if problem is not None:
        raise ValueError(f"{what} {path} exists and is {problem}: writing there would replace it; name another "
                         "file, or remove it first")  # fmt: skip


def _replaced(path: str, kind: str) -> str | None:
    """What the existing file at ``path`` is, in words, unless it is a file of ``kind`` (None)."""
    if not os.path.exists(path):
        return None
    try:
        if not h5py.is_hdf5(path):
            return "not an HDF5 file"
        with h5py.File(path, "r") as file:
            found = file_format(file)
    except OSError as error:
        return f"not a readable HDF5 file ({error})"
    if found is None:
        return "an HDF5 file from elsewhere (no mpiscale format)"
    if found.split("/")[0] == kind.split("/")[0]:
        return None
    job = job_of_results(found)
    return f"the results of mpiscale {job.name} ({found})" if job is not None else f"an mpiscale file ({found})"


def check_outputs(out: str, checkpoints: str | None, what: str = "the results file") -> None:
    """Raise ValueError if ``out`` (``what`` it is) or the checkpoint directory (None: not used) cannot be written."""
    if not out.strip():
        raise ValueError(f"{what} is named by an empty path: name a file")
    if os.path.isdir(out):
        example = os.path.join(out, "results" + (os.path.splitext(out)[1] or ".h5"))
        raise ValueError(f"{what} {out} is a directory: name a file (in it, say: {example})")
    directory = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(directory):
        blocking = next((part for part in [Path(directory), *Path(directory).parents] if part.exists()), None)
        if blocking is not None and not blocking.is_dir():
            raise ValueError(f"{what} {out} cannot be written: {blocking} is a file, not a directory")
        raise ValueError(not_found(out, f"{what}'s directory {directory} does not exist"))
    if not os.access(directory, os.W_OK):
        raise ValueError(f"{what}'s directory {directory} is not writable")
    if checkpoints is None:
        return
    path = Path(checkpoints)
    existing = path if path.exists() else path.parent
    if not existing.is_dir():
        raise ValueError(f"the checkpoint directory {path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"the checkpoint directory {path} cannot be written ({existing} is read-only)")


def check_not_an_input(out: str, inputs: Iterable[str], comm: Comm) -> None:
    """Raise ValueError on every rank if ``out`` is one of the job's ``inputs`` (collective).

    ``inputs`` are data specs: a file, ``FILE:/dataset``, a list of files or a
    pattern. Rank 0 alone lists the files (as the readers do) and says what it
    found. Paths are compared as the file system sees them, through symlinks,
    ``./`` spellings and hard links, so writing the results never replaces an
    input.
    """
    problem = _input_named_by(out, inputs) if comm.Get_rank() == 0 else None
    problem = comm.bcast(problem, 0)
    if problem is not None:
        raise ValueError(problem)


def _input_named_by(out: str, inputs: Iterable[str]) -> str | None:
    for spec in inputs:
        named = next((path for path in input_files(spec) if same_file(out, path)), None)
        if named is not None:
            shown = spec if named == split_spec(spec)[0] else f"{named}, listed by {spec}"
            return (
                f"the results file {out} is an input of this job ({shown}): writing it would replace the input; "
                "choose another --out"
            )
    return None


def input_files(spec: str) -> list[str]:
    """The files a data spec reads: the file it names, and those a list file or a pattern names (one process)."""
    pattern = split_spec(spec)[0]
    try:
        return list(dict.fromkeys([pattern, *resolve_files(pattern)]))
    except (DataFileError, OSError):  # a missing input: the job's own checks say so
        return [pattern]


def lock_results(out: str, comm: Comm) -> OutputLock | None:
    """Rank 0 takes ``out``'s lock (collective): a second job on the same outputs stops here, on every rank.

    Returns the lock on rank 0 (release it when the job ends), None elsewhere;
    raises LockedError on every rank when another job holds it.
    """
    lock, problem = None, None
    if comm is None or comm.Get_rank() == 0:
        lock = OutputLock(f"{out}.lock", f"the results file {out}")
        try:
            lock.acquire()
        except (LockedError, OSError) as error:
            lock, problem = None, error
    agree(comm, problem, "taking the results file", LockedError)
    return lock


def close_checkpointer(checkpoints: Checkpointer | None) -> CheckpointError | None:
    """Close ``checkpoints`` (its last save, then its lock); its failure is returned, for one report."""
    if checkpoints is None:
        return None
    try:
        checkpoints.close()
    except CheckpointError as error:
        return error
    return None


def give_back(lock: OutputLock | None, checkpoints: Checkpointer | None = None) -> None:
    """What a job that never started had claimed, given back: its checkpointer (and with it the checkpoint lock),
    then the results lock (None: nothing to give back)."""
    close_checkpointer(checkpoints)
    if lock is not None:
        lock.release()


async def write_results(
    system: ActorSystem,
    out: str,
    write: Callable[[h5py.File], None],
    done: str,
    failed: Callable[[OSError], str],
) -> None:
    """Rank 0 writes the results file ``out`` through ``write(file)``, then every rank agrees (collective).

    The file appears under ``out`` only once complete (a temporary name, then a
    rename), and a failure leaves nothing behind; it ends the job on every rank
    with status 1 and the message ``failed(error)``. Rank 0 prints ``done``
    once the file is written. Other ranks only agree.
    """
    problem = None
    if system.rank == 0:
        try:
            write_file(out, write)
        except OSError as error:
            problem = OSError(failed(error))
        else:
            print(done, flush=True)
    await system.agree(problem, "the results file", status=1)


def local_dir_option() -> str:
    """The ``--local-dir`` setting of a job that checkpoints (one help text for every job)."""
    return option(
        "",
        "node-local directory (each node's own disk: /local/scratch, $TMPDIR) for the checkpoints' shards, each "
        "copied to a rank on the next node, so a lost node loses nothing; empty: the checkpoint directory only",
    )


def shared_every_option() -> int:
    """The ``--shared-every`` setting that goes with ``--local-dir``."""
    return option(
        1, "with --local-dir: every Nth checkpoint also goes to the checkpoint directory (0: never, node-local only)"
    )


def checkpoint_level_problems(local_dir: str, shared_every: int) -> list[str]:
    """What is wrong with a job's ``--local-dir`` and ``--shared-every`` (nothing: an empty list)."""
    if shared_every < 0:
        return [f"shared_every must be 0 or more, got {shared_every}"]
    if shared_every == 0 and not local_dir:
        return ["--shared-every 0 keeps checkpoints on node-local disks only: it needs --local-dir"]
    return []


def open_checkpointer(directory: str, comm: Comm, local_dir: str, shared_every: int) -> Checkpointer:
    """The checkpointer of a job (collective): the newest two checkpoints, in ``directory`` and, with
    ``local_dir``, as node-local shards with partner copies."""
    return Checkpointer(directory, comm, keep=2, local_dir=local_dir or None, shared_every=shared_every)
