"""What a job's marks cost: ``mpiscale encode`` and ``mpiscale collect`` in small rounds, their rows marked done by
``--mark-every``.

A mark (the rows done, written into the output's attributes) flushes the file
before and after, each a sync of it, so that a killed run resumes from the last
one. Each job runs over the same rows each way (100,000 a rank; 20,000 with
``--quick``), in rounds of ``--batch-size`` 256 a rank, into a new file:
encode codes planted signals (64 values, 128 atoms, OMP with 3 non-zeros), and
collect runs them through a small model trained here for an epoch on the
bundled digits (64 inputs, a hidden layer of 16, its output kept). The floor
marks only the first round and the last (``--mark-every`` of an hour), the
default marks at most every quarter second, and the strictest way marks every
round (0). The ways take turns, each going first as often; a figure is the
median run's rows a second, whole runs as a user times them (the job's start
and its file's close included).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..dictlearn.config import EncodeConfig
from ..dictlearn.encode import encode
from ..io import write_dataset
from ..jobs import MARK_EVERY_S
from ..runtime import ActorSystem, run
from ..train.collect import collect
from ..train.config import CollectConfig, TrainConfig
from ..train.job import train
from .encode import planted_problem
from .report import Progress, scratch_folder, table, write_json

ATOMS, FEATURES, NONZERO = 128, 64, 3  # (64 values: the bundled digits' width, which collect's model takes)
BATCH = 256  # rows a rank handles per round: small rounds, where a mark's syncs weigh most
ROWS = {"full": 100_000, "quick": 20_000}  # a rank's
TURNS = {"full": 6, "quick": 2}  # runs of each way (even: each way goes first as often)
#: (name, --mark-every): the floor (the first round and the last), the default, every round.
WAYS = (("first and last", 3600.0), (f"every {MARK_EVERY_S} s (default)", MARK_EVERY_S),
        ("every round", 0.0))  # fmt: skip
Job = Callable[[float], Awaitable[object]]  # one run of a job with that --mark-every, writing its output


async def _rows_per_second(system: ActorSystem, job: Job, every: float, out: Path, rows: int) -> float:
    """Rows a second of one run of ``job`` marking at most every ``every`` s, writing ``out`` (rank 0's clock, a
    barrier at each end); its output removed after."""
    comm = system.world.comm
    comm.Barrier()
    started = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # (its "wrote ..." line, once a run)
        await job(every)
    comm.Barrier()
    seconds = time.perf_counter() - started
    if system.rank == 0:
        os.unlink(out)
    return rows / seconds


async def _jobs(system: ActorSystem, folder: Path, rows: int) -> dict[str, Job]:
    """Each job's run over the same ``rows`` planted signals (collective: rank 0 writes the inputs, and every rank
    trains collect's model for an epoch)."""
    comm = system.world.comm
    if system.rank == 0:
        dictionary, signals, _ = planted_problem(ATOMS, FEATURES, NONZERO, rows)
        np.save(folder / "atoms.npy", dictionary)
        write_dataset(str(folder / "signals.h5"), {"X": signals})
    comm.Barrier()
    model = str(folder / "model.h5")
    with contextlib.redirect_stdout(io.StringIO()):
        await train(system, TrainConfig(epochs=1, hidden=(16,), out=model, progress_every=0, device="cpu"))
    out, data = str(folder / "out.h5"), f"{folder / 'signals.h5'}:/X"
    coding = EncodeConfig(dictionary=str(folder / "atoms.npy"), data=data, sparsity=NONZERO, batch_size=BATCH,
                          device="cpu", out=out, progress_every=0)  # fmt: skip
    collecting = CollectConfig(model=model, data=data, layers=("relu1",), out=out, batch_size=BATCH, progress_every=0,
                               device="cpu")  # fmt: skip
    return {
        "encode": lambda every: encode(system, replace(coding, mark_every=every)),
        "collect": lambda every: collect(system, replace(collecting, mark_every=every)),
    }


async def run_marks(system: ActorSystem, json_path: str, scratch: str, quick: bool = False) -> dict | None:
    """Rank 0 prints the table and writes JSON; returns the record there."""
    size = "quick" if quick else "full"
    rows = ROWS[size] * system.size
    progress = Progress(system.rank == 0)
    measured: dict[str, dict[str, list[float]]] = {}
    with scratch_folder(system.world.comm, scratch, "marks") as folder:
        jobs = await _jobs(system, folder, rows)
        for name, job in jobs.items():
            timed = measured[name] = {way: [] for way, _ in WAYS}
            await _rows_per_second(system, job, 0.0, folder / "out.h5", rows)  # (a first run loads what all need)
            for turn in range(TURNS[size]):
                for way, every in WAYS[:: 1 if turn % 2 == 0 else -1]:
                    timed[way].append(await _rows_per_second(system, job, every, folder / "out.h5", rows))
                progress(f"{name}, turn {turn + 1} of {TURNS[size]}: each way went through {rows:,} rows")
    if system.rank != 0:
        return None
    rounds_run = -(-rows // (BATCH * system.size))
    print(f"mpiscale encode (OMP, {NONZERO} non-zeros of {ATOMS} atoms) and collect (a hidden layer of 16) of "
          f"{rows:,} rows of {FEATURES} values in {rounds_run:,} rounds of {BATCH} a rank on {system.size} rank(s); "
          f"the median of {TURNS[size]} runs each, in turns")  # fmt: skip
    records, lines = {}, []
    for name, timed in measured.items():
        median = {way: statistics.median(each) for way, each in timed.items()}
        floor = median[WAYS[0][0]]
        lines += [[name, way, every, median[way] / 1e3, floor / median[way], min(timed[way]) / 1e3,
                   max(timed[way]) / 1e3] for way, every in WAYS]  # fmt: skip
        records[name] = {"rows_per_second": timed, "time_vs_floor": {way: floor / median[way] for way, _ in WAYS}}
    print(table(["job", "marks", "--mark-every s", "k rows/s", "time / floor", "slowest", "fastest"], lines))
    results = {
        "baseline": "the same job marking its first round and its last only (--mark-every 3600), in turns",
        "rows": rows,
        "rounds": rounds_run,
        "batch_size": BATCH,
        "turns": TURNS[size],
        "jobs": records,
    }
    write_json(json_path, "marks", system.size, results)
    return results


def command(args: argparse.Namespace) -> int:
    """``mpiscale bench marks``: the options parsed, the benchmark run, its table printed and its JSON written."""
    run(lambda system: run_marks(system, args.json, args.dir, quick=args.quick))
    return 0
