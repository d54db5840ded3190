"""``DictionaryLearning`` as a user runs it under mpirun: each rank reads its own block of rows and fits.

``estimator_fit.py DATA.h5 OUT.npy SETTINGS_JSON MODE``. MODE ``plain``: the
estimator finds the launcher's world; ``runtime``: inside ``mpiscale.run``,
given the system's world; ``nan``: rank 1's rows hold a NaN, and every rank
must refuse (each prints its error); ``empty``: the last rank holds no rows, and fits, codes and
decodes its none; ``late``: the last rank comes to ``fit`` 3 s after the others (reading its rows, say);
``skips``: inside ``mpiscale.run``, rank 1 returns from ``main`` without calling ``fit`` (a branch only some ranks
take), and rank 0 calls it as most users do, blocking the event loop; ``skips-thread``: the same, rank 0 calling it
off the loop (``asyncio.to_thread``); ``skips-for-barrier``: rank 1 waits in the runtime's world barrier
instead; ``raises``: under mpirun, rank 1 raises before ``fit`` (it could not read its rows) and nothing
catches it; ``ends-without-fit``: under mpirun, rank 1's program ends without calling ``fit``;
``late-runtime``: ``late`` inside ``mpiscale.run``, the last rank awaiting its 3 s. Rank 0 saves the dictionary;
every rank checks that all ranks hold the same bits.
"""

import asyncio
import json
import sys
import time

import h5py
import numpy as np
from mpi4py import MPI

import mpiscale
from mpiscale.dictlearn import DictionaryLearning
from mpiscale.ranks import rank_rows

DATA, OUT, SETTINGS, MODE = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]


def my_rows(comm, holding: int | None = None) -> np.ndarray:
    """This rank's block of the rows split over ``holding`` ranks (all of them by default; ranks past it: none)."""
    holding = comm.Get_size() if holding is None else holding
    with h5py.File(DATA, "r") as file:
        signals = file["signals"]
        if comm.Get_rank() >= holding:
            return signals[:0]
        start, stop = rank_rows(len(signals), holding, comm.Get_rank())
        return signals[start:stop]


def fitted(rows: np.ndarray, **extra) -> DictionaryLearning:
    estimator = DictionaryLearning(**SETTINGS, **extra).fit(rows)
    codes = estimator.transform(rows)  # each rank its own rows, no communication
    assert codes.shape == (len(rows), estimator.n_components) and estimator.n_iter_ == SETTINGS["n_iter"]
    assert estimator.inverse_transform(codes).shape == rows.shape
    return estimator


def check_and_save(comm, dictionary: np.ndarray) -> None:
    everyone = comm.allgather(dictionary.tobytes())
    assert all(bits == everyone[0] for bits in everyone), "the ranks' dictionaries differ"
    if comm.Get_rank() == 0:
        np.save(OUT, dictionary)
        print(f"fitted on {comm.Get_size()} ranks", flush=True)


async def in_runtime(system: mpiscale.ActorSystem) -> None:
    estimator = fitted(my_rows(system.world.comm), comm=system.world)
    check_and_save(system.world.comm, estimator.components_)


async def late_in_runtime(system: mpiscale.ActorSystem) -> None:
    rows = my_rows(system.world.comm)
    if system.rank == system.size - 1:
        await asyncio.sleep(3)
    check_and_save(system.world.comm, fitted(rows, comm=system.world).components_)


async def skipping(system: mpiscale.ActorSystem) -> None:
    if system.rank == 1:
        if MODE == "skips-for-barrier":
            await system.world.barrier()
        return
    rows = my_rows(system.world.comm)
    if MODE == "skips-thread":
        await asyncio.to_thread(fitted, rows)
    else:
        fitted(rows)


if MODE == "runtime":
    mpiscale.run(in_runtime)
elif MODE == "late-runtime":
    mpiscale.run(late_in_runtime)
elif MODE.startswith("skips"):
    mpiscale.run(skipping)
elif MODE == "nan":
    rows = my_rows(MPI.COMM_WORLD)
    if MPI.COMM_WORLD.Get_rank() == 1:
        rows[0, 0] = np.nan
    try:
        DictionaryLearning(**SETTINGS).fit(rows)
    except ValueError as error:
        print(f"rank {MPI.COMM_WORLD.Get_rank()} refused: {error}", flush=True)
    MPI.COMM_WORLD.Barrier()  # every rank got here: none waits in a collective the others left
elif MODE == "raises":
    rows = my_rows(MPI.COMM_WORLD)
    if MPI.COMM_WORLD.Get_rank() == 1:
        raise FileNotFoundError("rank 1 could not read its rows")
    fitted(rows)
elif MODE == "ends-without-fit":
    rows = my_rows(MPI.COMM_WORLD)
    if MPI.COMM_WORLD.Get_rank() != 1:
        fitted(rows)
elif MODE == "late":
    rows = my_rows(MPI.COMM_WORLD)
    if MPI.COMM_WORLD.Get_rank() == MPI.COMM_WORLD.Get_size() - 1:
        time.sleep(3)
    check_and_save(MPI.COMM_WORLD, fitted(rows).components_)
elif MODE == "empty":
    check_and_save(MPI.COMM_WORLD, fitted(my_rows(MPI.COMM_WORLD, MPI.COMM_WORLD.Get_size() - 1)).components_)
else:
    check_and_save(MPI.COMM_WORLD, fitted(my_rows(MPI.COMM_WORLD)).components_)
