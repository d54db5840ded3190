"""One lifecycle for every job that runs in steps, and the telemetry and steering around any job.

``run_lifecycle`` drives a ``SteppedJob`` through the same phases whatever the
job: the agreed start (input checked, outputs locked), the restore, the steps
with progress, periodic checkpoints and steering, a final checkpoint, the
checkpoints closed, the results written with the ranks' agreement, the locks
released. A job supplies what differs: its steps (an async generator that
yields after each one), how it saves, and how it writes its results.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, TypeVar

from ..io import Checkpointer, CheckpointError, OutputLock, RowWriter, WriteError
from ..runtime import ActorSystem, JobRefused
from ..telemetry import Telemetry, set_current
from .outputs import close_checkpointer, start_agreed
from .progress import ProgressLine
from .state import announce, keep_for_resume, kept_name, steer, stopped_at_start

Result = TypeVar("Result")


@dataclass(frozen=True)
class Step:
    """What a job reports after each step: its progress text, the items it processed, the seconds per phase."""

    text: str
    items: float
    phases: dict[str, float] = field(default_factory=dict)
    reached: str | None = None  # the job reached its goal early (a target error): why it ends here


@dataclass(frozen=True)
class Plan:
    """How a job's steps are counted, shown and saved."""

    unit: str  # what a step is called in messages ("iteration", "step")
    counts: str  # what ``Step.items`` counts, for the rate ("signals", "samples")
    total: int  # the steps of a whole run
    progress_every: float | None  # seconds between progress lines (rank 0; 0: only the last; None: none)
    checkpoint_every: int = 0  # a checkpoint every N steps (0: only on a request)
    saves: bool = False  # it keeps checkpoints (False: a stop request stops it without one)
    checkpoint_at_end: bool = False  # one after the last step too, so the state outlives a failed results write


@dataclass(frozen=True)
class Ended:
    """How the steps ended: after ``done`` steps, on a stop request, on the job's own goal, or at the last step."""

    done: int
    stopped: bool
    reached: str | None


class SteppedJob(Protocol):
    """What a job gives ``run_lifecycle``: built by its ``prepare`` once the input checked out on every rank."""

    plan: Plan

    async def restore(self) -> int:
        """The steps already done: those of the checkpoint a resumed run continues (collective)."""
        ...

    def steps(self, start: int) -> AsyncGenerator[Step, None]:
        """Run the steps after the first ``start``, yielding after each (collective; closed early on a stop)."""
        ...

    def save(self, done: int) -> Awaitable[None] | None:
        """Checkpoint the state after ``done`` steps (collective)."""
        ...

    def close_checkpoints(self) -> CheckpointError | None:
        """Finish the checkpoints (their last save, their lock); a failure is returned, for one report."""
        ...

    async def finish(self, ended: Ended) -> dict:
        """Write the results with the ranks' agreement; the job's summary (collective)."""
        ...

    def release(self) -> None:
        """Give back what ``prepare`` took (the results file's lock), whatever happened."""
        ...


class HeldOutputs:
    """``close_checkpoints`` and ``release`` for a ``SteppedJob`` that holds a checkpointer and the results lock."""

    checkpoints: Checkpointer | None
    results_lock: OutputLock | None  # rank 0's hold on the results path

    def close_checkpoints(self) -> CheckpointError | None:
        return close_checkpointer(self.checkpoints)

    def release(self) -> None:
        if self.results_lock is not None:
            self.results_lock.release()


class OutputAsState(HeldOutputs):
    """``HeldOutputs`` for a job whose output file is its only state (encode, collect, compress-adapters, circuits
    run): ``restore`` opens ``writer``, a save flushes it, and after a failure it stays open for ``--resume``
    (``keep_for_resume``). ``command`` and ``kept_work`` name the job and what its file holds, for that line."""

    system: ActorSystem
    checkpoints: None = None
    writer: RowWriter | None = None
    command: ClassVar[str]  # "encode"
    kept_work: ClassVar[str]  # "the signals coded so far"

    def save(self, done: int) -> None:
        self._writer.flush()  # every step's output is in the file, marked

    def keep_stopped(self, what: str) -> None:
        """A stopped run's output closed as ``OUT.partial`` for ``--resume`` (collective), and where said on rank 0:
        ``what`` it holds ("the coded signals")."""
        kept = kept_name(self._writer.path)
        self._writer.close(kept)
        if self.system.rank == 0:
            print(f"mpiscale {self.command}: kept {what} in {kept}; run the same command with --resume (on any number "
                  "of ranks) to finish", flush=True)  # fmt: skip

    def say_resumed(self, kept: str, done: int, total: int, what: str) -> None:
        """That this run goes on from ``kept``, an earlier run's file holding ``done`` of ``total`` ``what`` ("signals
        were coded"): on rank 0's output and in the job's telemetry."""
        said = f"{done:,} of {total:,} {what}"
        if self.system.rank == 0:
            print(f"mpiscale {self.command}: resumed from {kept}: {said}", flush=True)
        announce("resumed", f"from {kept}: {said}")

    def release(self) -> None:
        super().release()
        keep_for_resume(self.writer, self.system.rank, self.command, self.kept_work)

    @property
    def _writer(self) -> RowWriter:
        assert self.writer is not None, "the output is opened by restore"
        return self.writer


def _give_up(job: SteppedJob) -> None:
    """What a prepared job claimed, given back when another rank refused it: its checkpointer, then its lock."""
    job.close_checkpoints()
    job.release()


async def run_lifecycle(system: ActorSystem, command: str, prepare: Callable[[], SteppedJob]) -> dict:
    """Run the job ``prepare()`` builds on every rank, through every phase (collective); its summary.

    Bad input ends every rank before the first step with one message and
    status 2 (see ``start_agreed``). A checkpoint or output file that cannot be
    written (``CheckpointError``, ``WriteError``: raised alike on every rank, by
    their contract) ends it with status 1, in one message, after the
    checkpoints closed; so does a results file that cannot be written.
    """
    job = await start_agreed(system, command, prepare, _give_up)
    try:
        if await stopped_at_start(system):
            failure = job.close_checkpoints()
            if failure is not None:
                raise JobRefused(f"mpiscale {command}: {failure}", status=1) from None
            return {"stopped": True, "steps": 0}
        failed: CheckpointError | WriteError | None = None
        try:
            ended = await _run_steps(system, job, await job.restore())
        except (CheckpointError, WriteError) as error:
            failed = error
        finally:
            closing = job.close_checkpoints()  # always: it releases the directory's lock
            failed = failed or closing
        if failed is not None:
            raise JobRefused(f"mpiscale {command}: {failed}", status=1) from None
        try:
            return await job.finish(ended)
        except WriteError as error:
            raise JobRefused(f"mpiscale {command}: {error}", status=1) from None
    finally:
        job.release()


async def _run_steps(system: ActorSystem, job: SteppedJob, start: int) -> Ended:
    """The steps from ``start``: progress, checkpoints every ``checkpoint_every`` and at the end, steering."""
    plan = job.plan
    progress = ProgressLine(
        plan.total, start, plan.progress_every if system.rank == 0 else None, plan.counts, plan.unit
    )
    done, saved = start, start  # a resumed run's start is already saved
    stopped, reached = False, None

    async def save() -> None:
        nonlocal saved
        if saved != done:
            saving = job.save(done)
            if inspect.isawaitable(saving):
                await saving
            saved = done

    async with contextlib.aclosing(job.steps(start)) as steps:
        async for step in steps:
            done += 1
            progress.update(done, step.text, step.items, step.phases)
            if plan.saves and plan.checkpoint_every and done % plan.checkpoint_every == 0:
                await save()
            stopped = await steer(system, f"{plan.unit} {done}", save if plan.saves else None)
            if stopped or step.reached:
                reached = None if stopped else step.reached
                break
    progress.finish()
    if plan.saves and plan.checkpoint_at_end:
        await save()
    return Ended(done, stopped, reached)


async def observed(
    system: ActorSystem, command: str, out: str | None, work: Callable[[], Awaitable[Result]], steers: bool = True
) -> Result:
    """Run ``work()`` with this rank's telemetry session current (collective start and end).

    ``steers``: the job calls ``jobs.steer`` at every step's end (as
    ``run_lifecycle`` does), so it obeys SIGTERM and the checkpoint and stop
    commands, with telemetry on or off. Steering begins before telemetry takes
    commands and ends however the job ends.
    """
    if steers:
        system.steering.begin()
    try:
        session = await Telemetry.start(system, command, out)
        set_current(session)
        try:
            result = await work()
        except BaseException as error:
            if isinstance(error, JobRefused) and error.status == 2:
                session.refused()  # bad input: "before anything is written" holds for telemetry files too
            await session.fail(f"{type(error).__name__}: {error}")
            raise
        finally:
            set_current(None)
        await session.close()
        return result
    finally:
        if steers:
            system.steering.end()
