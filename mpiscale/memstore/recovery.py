"""Rebuilding the store after a failure: the newest checkpoint, then every commit all logs hold, on any world size.

Each old rank's log is read by one new rank on a node that holds it: its own
node's copy if that node is still there, else the partner's copy. A commit is
replayed only if every old rank's log holds it (a rank killed mid-commit left
the others ahead of it), so the state is the one the job had after that
commit, on every rank; the job redoes what came after. Replayed operations are
routed to their owners in the new world and applied as they were the first
time, so the records are the same bits as before the failure. The recovered
state is then checkpointed, so the old logs can go and the new run's start
from there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from ..io import CheckpointError, DataFileError
from ..ranks import on_rank_0
from .journal import Commit, Journal, Op, existing_segments, lost_logs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Replica:
    """What the durability needs of a store: its columns, how to replay into it, read it whole and count it."""

    columns: tuple[str, ...]
    #: Apply one logged operation again (collective): its kind, its scalar, and the parts of it this rank read.
    apply: Callable[[str, float, list[Op]], Awaitable[None]]
    #: This rank's records for a checkpoint: ``ids`` and one array per column.
    snapshot: Callable[[], dict[str, np.ndarray]]
    #: How many records this rank holds.
    records: Callable[[], int]


@dataclass
class Recovered:
    """What a durable store's ``recover`` rebuilt."""

    commits: int  # the store holds the state after this commit
    checkpoint: int  # the commit of the checkpoint it started from (0: none, only logs)
    notes: list[dict[str, np.ndarray]]  # the notes of the replayed commits, checkpoint + 1 .. commits
    replicated: dict[str, np.ndarray]  # the caller's arrays saved with the checkpoint
    meta: dict  # the caller's metadata saved with the checkpoint
    records: int  # records in the store, over all ranks
    source: str  # where the checkpoint and the logs came from
    seconds: dict[str, float] = field(default_factory=dict)  # load, replay, checkpoint, total


async def recover(
    journal: Journal,
    replica: Replica,
    save: Callable[[int, dict, dict], None],
    meta: dict,
    accept_rollback: bool = False,
) -> Recovered | None:
    """Restore ``replica`` from its checkpoints and logs (collective); None when there is nothing to restore.

    ``save(commit, replicated, meta)`` checkpoints the recovered state, when
    commits were replayed. Committed data is never dropped silently: logs that
    are gone or damaged, or a missing ``journal.json`` beside earlier logs or
    checkpoints, raise a CheckpointError naming what is missing and what would
    be lost, unless ``accept_rollback`` (then: a warning, and the state of the
    newest commit every remaining log holds).
    """
    began = time.perf_counter()
    comm = journal.comm
    record = on_rank_0(comm, journal.read_record, (CheckpointError,))
    if record is None:
        _no_record(journal, accept_rollback)
    if record is not None and record.get("meta") != meta:
        raise CheckpointError(_difference(journal, record.get("meta", {}), meta))
    restored = journal.checkpoints.load()
    checkpoint = restored.step if restored is not None else 0
    if restored is not None:
        saved = restored.meta.get("store", {})
        if saved.get("columns") != list(replica.columns):
            raise CheckpointError(
                f"the checkpoint in {journal.directory} holds the columns {saved.get('columns')}, "
                f"this store has {list(replica.columns)}"
            )
        table = np.column_stack([restored.sharded[name].astype(np.float64) for name in replica.columns])
        await replica.apply("upsert", 0.0, [Op("upsert", restored.sharded["ids"], table)])
    loaded = time.perf_counter()
    commits: list[Commit] = []
    source = "no checkpoint"
    if restored is not None:
        source = f"the checkpoint of commit {checkpoint} ({', '.join(sorted(set(restored.sources.values())))})"
    if record is not None:
        commits, logs = await _replay(replica, journal, record, checkpoint, accept_rollback)
        source += f"; {len(commits)} commits from {logs}"
    replayed = time.perf_counter()
    last = checkpoint + len(commits)
    replicated = restored.replicated if restored is not None else {}
    caller_meta = restored.meta.get("caller", {}) if restored is not None else {}
    if commits:  # the new logs start from a checkpoint of the recovered state
        save(last, replicated, caller_meta)
        journal.checkpoints.wait()
    journal.begin(last, meta)
    if last == 0:
        return None
    total = await journal.system.world.allreduce(np.array([replica.records()], np.int64))
    done = time.perf_counter()
    return Recovered(
        commits=last,
        checkpoint=checkpoint,
        notes=[commit.notes for commit in commits],
        replicated=replicated,
        meta=caller_meta,
        records=int(total[0]),
        source=source,
        seconds={
            "load": loaded - began,
            "replay": replayed - loaded,
            "checkpoint": done - replayed,
            "total": done - began,
        },
    )


def _no_record(journal: Journal, accept_rollback: bool) -> None:
    """Without ``journal.json``, refuse to start over while logs or checkpoints of an earlier run are there."""
    comm = journal.comm
    logs = len({(s.node, s.folder, s.name) for listing in comm.allgather(journal.listing(None)) for s in listing})
    steps = journal.checkpoints.steps()
    if not logs and not steps:
        return
    found = ", ".join([f"{logs} log files"] * bool(logs) + [f"checkpoints {steps}"] * bool(steps))
    _refuse_rollback(accept_rollback, (
        f"{journal.record_file} is missing, but {found} of an earlier run are there: the file names the run whose "
        "logs hold the commits after the newest checkpoint, so starting without it would lose them. Restore it"
    ), journal.comm)  # fmt: skip


def _refuse_rollback(accept_rollback: bool, problem: str, comm) -> None:
    """Raise ``problem`` (the same on every rank), or, when the caller accepts the rollback, warn once and go on."""
    if not accept_rollback:
        raise CheckpointError(f"{problem}, or accept the loss with accept_rollback (mpiscale memstore "
                              "--accept-rollback)")  # fmt: skip
    if comm.Get_rank() == 0:
        log.warning("%s; the rollback is accepted: recovering what remains", problem)


def _difference(journal: Journal, saved: dict, meta: dict) -> str:
    keys = sorted(set(saved) | set(meta))
    differences = [f"{k}: logged {saved.get(k)!r}, now {meta.get(k)!r}" for k in keys if saved.get(k) != meta.get(k)]
    return f"the store in {journal.directory} belongs to another job ({'; '.join(differences)})"


async def _replay(
    replica: Replica, journal: Journal, record: dict, after: int, accept_rollback: bool
) -> tuple[list[Commit], str]:
    """Apply every commit after ``after`` that all logs of the run in ``record`` hold; returns them and where they
    came from."""
    comm, run = journal.comm, record["run"]
    found = [segment for listing in comm.allgather(journal.listing(run)) for segment in listing]
    found = list({(s.node, s.folder, s.name): s for s in found}.values())  # ranks on one node list the same files
    plan = on_rank_0(comm, lambda: existing_segments(run, found), (CheckpointError,))
    lost = lost_logs(found, record.get("ranks"))
    if lost:
        _refuse_rollback(accept_rollback, (
            f"the logs of run {run} of ranks {lost} are gone from {journal.wal_places()} (a node's disk "
            f"and its partner's copy lost, or another --local-dir): every commit after the checkpoint of commit "
            f"{after} would be lost. Bring the node-local directories back"
        ), comm)  # fmt: skip
        plan = {}
    readers = _assign(plan, journal.nodes_of)
    mine: dict[int, list[Commit]] = {}
    torn: dict[int, str] = {}
    problem = None
    try:
        for old_rank, segments in plan.items():
            if readers[old_rank] == comm.Get_rank():
                mine[old_rank], torn_log = journal.read(segments, after)
                if torn_log:
                    torn[old_rank] = torn_log
    except (CheckpointError, DataFileError) as error:
        problem = str(error)
    world = journal.system.world
    await world.agree(problem, "memory store", CheckpointError)
    _check_torn_tails(mine, torn, after, accept_rollback, comm)
    reach = min((len(commits) for commits in mine.values()), default=np.iinfo(np.int64).max)
    every = np.array([reach], np.int64)
    await world.allreduce(every, op="min", out=every)
    count = int(every[0]) if plan else 0
    holder = readers.get(min(plan), 0) if plan else 0
    schedule = None
    if plan and comm.Get_rank() == holder:
        schedule = [(c.number, [(op.kind, op.scalar) for op in c.ops], c.notes) for c in mine[min(plan)][:count]]
    schedule = comm.bcast(schedule, holder)
    commits = []
    for index in range(count):
        number, steps, notes = schedule[index]
        held = [commits_of[index] for commits_of in mine.values()]
        odd = any([(op.kind, op.scalar) for op in commit.ops] != steps for commit in held)
        disagree = f"the logs of run {run} disagree on the operations of commit {number}" if odd else None
        await world.agree(disagree, "memory store", CheckpointError)
        for j, (kind, scalar) in enumerate(steps):
            await replica.apply(kind, scalar, [commit.ops[j] for commit in held])
        commits.append(Commit(number, [], notes))
    copies = sum(1 for segments in plan.values() if segments[0].copy)
    where = f"{len(plan)} logs ({copies} of them partner copies)" if plan else "no logs"
    if comm.Get_rank() == 0 and count < max((len(c) for c in mine.values()), default=0):
        log.info("commits after %d are not in every log (a rank died mid-commit): they are redone", after + count)
    return commits, where


def _check_torn_tails(mine: dict[int, list[Commit]], torn: dict[int, str], after: int, accept: bool, comm) -> None:
    """A crash tears at most the commit in flight: a log that ends torn more than one commit behind the others is
    damaged (a bad length field, say), and trusting it would drop the intact commits after it (collective)."""
    every = [held for part in comm.allgather([(len(c), torn.get(r, "")) for r, c in mine.items()]) for held in part]
    most = max((count for count, _ in every), default=0)
    damaged = sorted((count, path) for count, path in every if path and count < most - 1)
    if damaged:
        count, path = damaged[0]
        _refuse_rollback(accept, (
            f"the log {path} is damaged after commit {after + count} (its next record's frame is cut short while "
            f"other logs hold commits up to {after + most}, and a crash tears only the commit in flight): the "
            f"commits after {after + count} would be lost. Restore the file"
        ), comm)  # fmt: skip


def _assign(plan: dict, nodes_of: list[int]) -> dict[int, int]:
    """The rank that reads each old rank's log: one on the node that holds it, taking turns."""
    ranks_by_node: dict[int, list[int]] = {}
    for rank, node in enumerate(nodes_of):
        ranks_by_node.setdefault(node, []).append(rank)
    turns: dict[int, int] = {}
    readers = {}
    for old_rank, segments in sorted(plan.items()):
        node = segments[0].node
        turn = turns.get(node, 0)
        readers[old_rank] = ranks_by_node[node][turn % len(ranks_by_node[node])]
        turns[node] = turn + 1
    return readers
