"""What a job's marks cost: ``mpiscale encode`` in small rounds, its rows marked done by ``--mark-every``.

A mark (the rows done, written into the output's attributes) flushes the file
before and after, each a sync of it, so that a killed run resumes from the last
one. Each way codes the same planted signals (100,000 a rank; 20,000 with
``--quick``), in rounds of ``--batch-size`` 256 a rank, OMP with 3 non-zeros,
into a new file: the floor marks only the first round and the last (``--mark-every``
of an hour), the default marks at most every quarter second, and the
strictest way marks every round (0). The ways take turns, each going first
as often; a figure is the median run's signals a second, whole runs as a user
times them (the job's start and its file's close included).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import time
from dataclasses import replace

import numpy as np

from ..dictlearn.config import EncodeConfig
from ..dictlearn.encode import encode
from ..io import write_dataset
from ..jobs import MARK_EVERY_S
from ..runtime import ActorSystem, run
from .encode import planted_problem
from .report import Progress, scratch_folder, table, write_json

ATOMS, FEATURES, NONZERO = 128, 64, 3
BATCH = 256  # signals a rank codes per round: small rounds, where a mark's syncs weigh most
SIGNALS = {"full": 100_000, "quick": 20_000}  # a rank's
TURNS = {"full": 6, "quick": 2}  # runs of each way (even: each way goes first as often)
#: (name, --mark-every): the floor (the first round and the last), the default, every round.
WAYS = (("first and last", 3600.0), (f"every {MARK_EVERY_S} s (default)", MARK_EVERY_S),
        ("every round", 0.0))  # fmt: skip


async def _signals_per_second(system: ActorSystem, config: EncodeConfig) -> float:
    """Signals a second of one encode run writing ``config.out`` (rank 0's clock, a barrier at each end)."""
    comm = system.world.comm
    comm.Barrier()
    started = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # (its "wrote ..." line, once a run)
        summary = await encode(system, config)
    comm.Barrier()
    seconds = time.perf_counter() - started
    if system.rank == 0:
        os.unlink(config.out)
    return summary["signals"] / seconds


async def run_marks(system: ActorSystem, json_path: str, scratch: str, quick: bool = False) -> dict | None:
    """Rank 0 prints the table and writes JSON; returns the record there."""
    comm = system.world.comm
    size = "quick" if quick else "full"
    signals = SIGNALS[size] * system.size
    progress = Progress(system.rank == 0)
    measured: dict[str, list[float]] = {name: [] for name, _ in WAYS}
    with scratch_folder(comm, scratch, "marks") as folder:
        if system.rank == 0:
            dictionary, data, _ = planted_problem(ATOMS, FEATURES, NONZERO, signals)
            np.save(folder / "atoms.npy", dictionary)
            write_dataset(str(folder / "signals.h5"), {"X": data})
        comm.Barrier()
        settings = EncodeConfig(dictionary=str(folder / "atoms.npy"), data=f"{folder / 'signals.h5'}:/X",
                                sparsity=NONZERO, batch_size=BATCH, device="cpu", out=str(folder / "codes.h5"),
                                progress_every=0)  # fmt: skip
        await _signals_per_second(system, settings)  # (a first run loads what every run needs)
        for turn in range(TURNS[size]):
            for name, every in WAYS[:: 1 if turn % 2 == 0 else -1]:
                measured[name].append(await _signals_per_second(system, replace(settings, mark_every=every)))
            progress(f"turn {turn + 1} of {TURNS[size]}: each way coded {signals:,} signals")
    if system.rank != 0:
        return None
    median = {name: statistics.median(each) for name, each in measured.items()}
    floor = median[WAYS[0][0]]
    rounds_run = -(-signals // (BATCH * system.size))
    print(f"mpiscale encode of {signals:,} signals ({FEATURES} values, {ATOMS} atoms, OMP {NONZERO} non-zeros) in "
          f"{rounds_run:,} rounds of {BATCH} a rank on {system.size} rank(s); the median of {TURNS[size]} runs each, "
          "in turns")  # fmt: skip
    rows = [[name, every, median[name] / 1e3, floor / median[name], min(measured[name]) / 1e3,
             max(measured[name]) / 1e3] for name, every in WAYS]  # fmt: skip
    print(table(["marks", "--mark-every s", "k signals/s", "time / floor", "slowest", "fastest"], rows))
    results = {
        "baseline": "the same job marking its first round and its last only (--mark-every 3600), in turns",
        "signals": signals,
        "rounds": rounds_run,
        "batch_size": BATCH,
        "turns": TURNS[size],
        "signals_per_second": measured,
        "time_vs_floor": {name: floor / median[name] for name, _ in WAYS},
    }
    write_json(json_path, "marks", system.size, results)
    return results


def command(args: argparse.Namespace) -> int:
    """``mpiscale bench marks``: the options parsed, the benchmark run, its table printed and its JSON written."""
    run(lambda system: run_marks(system, args.json, args.dir, quick=args.quick))
    return 0
