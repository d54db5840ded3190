"""A job's state across ranks and runs: the checkpoint a resumed run may take, and one set of bits at the end."""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import sys
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Protocol

import h5py
import numpy as np

from .. import telemetry
from ..io import Checkpointer, CheckpointError, DataFileError, Restored, RowWriter, checksum
from ..runtime import ActorSystem

log = logging.getLogger(__name__)


class Stateful(Protocol):
    """A part of a job's state that checkpoints save and restore: named arrays out, the same arrays back in place.

    The names are the part's own (prefixed where parts share a checkpoint), and
    ``from_arrays`` takes what ``to_arrays`` gave, on any number of ranks.
    """

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The state as named arrays (copies, or arrays the job no longer changes)."""
        ...

    def from_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Take the state ``to_arrays`` gave; a missing or misshapen array is a ValueError."""
        ...


def state_arrays(*parts: Stateful) -> dict[str, np.ndarray]:
    """Every part's arrays in one mapping (a checkpoint's replicated arrays); two parts may not share a name."""
    arrays: dict[str, np.ndarray] = {}
    for part in parts:
        own = part.to_arrays()
        shared = sorted(arrays.keys() & own.keys())
        if shared:
            raise ValueError(f"{type(part).__name__} names arrays another part of the state names: {shared}")
        arrays |= own
    return arrays


def load_state(arrays: Mapping[str, np.ndarray], *parts: Stateful) -> None:
    """Every part takes its arrays back from ``arrays`` (what ``state_arrays`` gave)."""
    for part in parts:
        part.from_arrays(arrays)


#: Where a checkpoint's metadata keeps the settings a resumed run must share; older checkpoints used these keys.
SETTINGS_KEY = "settings"
_OLDER_SETTINGS_KEYS = ("config", "job")  # dictlearn's and train's before one key served every job


def settings_meta(expected: dict) -> dict:
    """The metadata that ties a checkpoint to the settings of its job (see ``restore_compatible``)."""
    return {SETTINGS_KEY: expected}


def restore_compatible(
    checkpoints: Checkpointer,
    resume: bool,
    directory: str,
    expected: dict,
    unit: str,
    check: Callable[[Restored], None] | None = None,
    rows: dict[str, tuple[int, int]] | None = None,
    why: Mapping[str, str] | None = None,
    added: Mapping[str, object] | None = None,
) -> Restored | None:
    """The newest checkpoint when ``resume`` (None if there is none), or None when starting afresh; ``rows`` are
    the rows of sharded arrays this rank reads (``Checkpointer.load``'s; by default its block).

    Without ``resume`` an existing checkpoint is refused, never overwritten.
    ``expected`` is compared with the settings the checkpoint was saved with
    (``settings_meta``), and a checkpoint of another job is refused, naming
    every setting that differs (first: a step count means nothing under other
    settings); ``check`` (the step against the run's length, say) runs next.
    ``unit`` names a step ("iteration", "step") in the messages; ``why`` says, for a setting that must not change,
    why and what to do instead. ``added``: settings introduced after checkpoints were first written, each with the
    value a checkpoint that does not record it was saved with.
    """
    if not resume:
        steps = checkpoints.steps()
        if steps:
            raise CheckpointError(
                f"{directory} already holds checkpoints (newest: {unit} {steps[0]}); "
                "pass --resume to continue from them, or choose another --checkpoint-dir"
            )
        return None
    restored = checkpoints.load(rows=rows, announce=False)  # said once it is taken: a refused one says nothing
    if restored is None:
        return None
    keys = (SETTINGS_KEY, *_OLDER_SETTINGS_KEYS)
    saved: dict = {**(added or {}), **next((restored.meta[key] for key in keys if key in restored.meta), {})}
    differences = setting_differences(saved, expected, "checkpoint", why)
    if differences:
        raise CheckpointError(f"the checkpoint in {directory} belongs to another job ({'; '.join(differences)})")
    if check is not None:
        check(restored)
    checkpoints.announce(restored)
    announce("resumed", f"from the checkpoint of {unit} {restored.step} in {directory}")
    return restored


def setting_differences(saved: dict, expected: dict, then: str, why: Mapping[str, str] | None = None) -> list[str]:
    """``KEY: THEN old, now new`` for each setting of ``expected`` that ``saved`` (an earlier run's) holds otherwise,
    followed by ``why[KEY]`` in brackets where it says why that setting must stay and what to do."""
    why = why or {}
    return [f"{key}: {then} {saved.get(key)!r}, now {value!r}" + (f" ({why[key]})" if key in why else "")
            for key, value in expected.items() if saved.get(key) != value]  # fmt: skip


def kept_name(out: str) -> str:
    """Where a job stopped before its end keeps the output it wrote so far (``--resume`` goes on from it)."""
    return f"{out}.partial"


def earlier_output(out: str) -> str | None:
    """The file an earlier run writing ``out`` left for ``--resume``: ``OUT.partial`` where it was stopped, else
    ``OUT.tmp`` where it was killed or failed (complete as far as it marked); None where it left neither."""
    return next((kept for kept in (kept_name(out), f"{out}.tmp") if os.path.exists(kept)), None)


@contextlib.contextmanager
def kept_file(kept: str, file_format: str, mark: str) -> Iterator[h5py.File]:
    """An earlier run's kept file (``earlier_output``), open to read its marks and settings: one cut off before it
    could be resumed (not HDF5, another ``format``, no attribute ``mark``, or what the block reads missing) is
    refused as such, naming the file."""
    try:
        with h5py.File(kept, "r") as file:
            if file.attrs.get("format") != file_format or mark not in file.attrs:
                raise OSError(f"no {mark} of a {file_format} file")
            yield file
    except (OSError, KeyError, ValueError):
        raise DataFileError(kept, "cannot be resumed: it was cut off before it was complete enough; remove it and "
                                  "run again") from None  # fmt: skip


def keep_for_resume(writer: RowWriter | None, rank: int, job: str, what: str) -> None:
    """After a failure mid-run, maybe a dead rank's: the output stays open under its temporary name for
    ``--resume`` (closing it is collective, and could wait for the dead rank for ever), and rank 0 says where.
    ``what``: the work it holds, complete as far as it is marked ("the signals coded so far")."""
    if writer is None or writer.file is None:
        return
    writer.keep()
    if rank == 0:
        print(f"mpiscale {job}: {what} are kept in {writer.temporary}; run the same command with --resume to finish",
              file=sys.stderr, flush=True)  # fmt: skip


def announce(event: str, detail: str) -> None:
    """An event of the running job's telemetry, if there is one."""
    session = telemetry.current()
    if session is not None:
        session.event(event, detail)


async def steer(system: ActorSystem, where: str, save: Callable[[], Awaitable[None] | None] | None) -> bool:
    """At a step's end, on every rank (collective): obey the stop and checkpoint requests the ranks agreed on.

    The requests come from SIGTERM and from telemetry's commands, through the
    runtime's steering (with telemetry on or off). ``save`` checkpoints the
    state after this step (None: the job keeps no checkpoints). Returns True
    when the job must stop now.
    """
    orders = await system.steering.agree()
    if not orders:
        return False
    if save is not None:
        saving = save()
        if inspect.isawaitable(saving):
            await saving
    session = telemetry.current()
    if session is not None:
        session.obeyed(orders, where, checkpointed=save is not None)
    if orders.stop and system.rank == 0:
        how = "a resumed run goes on from there" if save is not None else "it kept no checkpoint to resume from"
        print(f"mpiscale: stopped on request (a stop command or SIGTERM) after {where}; {how}", flush=True)
    return orders.stop


async def stopped_at_start(system: ActorSystem) -> bool:
    """Collective, once a job's input checked out and before anything else: whether a stop request came already
    (a SIGTERM while the ranks started, a stop command), which ends the job here, saying so on rank 0. A checkpoint
    request waits for the first step's end: there is nothing new to save yet."""
    if not system.steering.active:
        return False
    orders = await system.steering.agree_now()
    if not orders.stop:
        for id in orders.ids if orders.checkpoint else []:
            system.steering.request("checkpoint", id)
        if orders.checkpoint and not orders.ids:
            system.steering.request("checkpoint")
        return False
    session = telemetry.current()
    if session is not None:
        session.obeyed(orders, "the start", checkpointed=False)
    if system.rank == 0:
        print("mpiscale: stopped on request (a stop command or SIGTERM) before the first step; nothing to checkpoint",
              flush=True)  # fmt: skip
    return True


async def same_bits_everywhere(system: ActorSystem, arrays: list[np.ndarray], what: str) -> None:
    """Check that every rank ends with the very same ``arrays``; if not, give every rank rank 0's and say so.

    The arrays must be C-contiguous and writable (they are overwritten in place).
    """
    digest = np.array([checksum(array) for array in arrays], dtype=np.int64)
    every = await system.world.allgather(digest)
    if (every != every[0]).any():
        if system.rank == 0:
            log.warning("ranks ended with %s that differ in the last bits; keeping rank 0's", what)
        for array in arrays:
            await system.world.bcast_array(array, 0)
