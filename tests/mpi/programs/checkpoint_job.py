"""One phase of a checkpoint scenario; the test runs several phases as separate jobs.

usage: checkpoint_job.py MODE SHARED_DIR LOCAL_DIR [STEP...]
  save STEP...     save these steps (every 2nd to the shared level), then close
  load [STEP]      restore the newest (or STEP) and check every array bit for bit
  delta            saves 101 (full), 102 and 103 (deltas: "x" is unchanged, so only the full save stores it)
  fail-async       make the shared directory unusable, save in the background, expect the error everywhere
  no-close         save in the background, break the shared directory, exit without close()
  mismatch         rank 1 passes another dtype: every rank must refuse the save
  kill             save step 1, start a large background save of step 2, write rank 1's pid to victim.pid, wait
The state of step s is a pure function of s, so any job can check what another saved.
"""

import os
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

import mpiscale
from mpiscale.io import Checkpointer, CheckpointError
from mpiscale.ranks import rank_rows

ROWS = 23


def state(step: int, rows: int = ROWS) -> dict:
    """Steps from 101 on share "x" (slowly changing weights: what delta saves skip)."""
    rng = np.random.default_rng(step)
    return {
        "x": np.random.default_rng(min(step, 101)).standard_normal((rows, 4)),
        "ids": np.arange(rows, dtype=np.int64) * step,
        "w": rng.standard_normal((5, 5)).astype(np.float32),
        "lr": np.float64(0.1 * step),
    }


def saved_rows(size: int, rank: int, rows: int = ROWS) -> tuple[int, int]:
    """Uneven on purpose: rank 0 owns no rows, the others split them."""
    if size == 1:
        return 0, rows
    if rank == 0:
        return 0, 0
    return rank_rows(rows, size - 1, rank - 1)


def save(checkpoints: Checkpointer, step: int, comm, rows: int = ROWS, x=None) -> None:
    full = state(step, rows)
    full["x"] = full["x"] if x is None else x
    start, stop = saved_rows(comm.size, comm.rank, rows)
    checkpoints.save(
        step,
        sharded={"x": full["x"][start:stop], "ids": full["ids"][start:stop]},
        replicated={"w": full["w"], "lr": np.asarray(full["lr"])},
        meta={"step": step, "rng": np.random.default_rng(step).bit_generator.state},
    )


def check(restored, step: int, comm) -> None:
    full = state(step)
    start, stop = rank_rows(ROWS, comm.size, comm.rank)
    assert restored.step == step, (restored.step, step)
    assert restored.rows["x"] == (start, stop)
    for name in ("x", "ids"):
        assert restored.sharded[name].dtype == full[name].dtype
        assert np.array_equal(restored.sharded[name], full[name][start:stop]), name
    assert np.array_equal(restored.replicated["w"], full["w"]) and restored.replicated["w"].dtype == np.float32
    assert restored.replicated["lr"].shape == () and restored.replicated["lr"] == full["lr"]
    assert restored.meta["rng"] == np.random.default_rng(step).bit_generator.state


async def main(system):
    mode, shared, local, *steps = sys.argv[1:]
    comm = MPI.COMM_WORLD
    every = dict(keep=2, local_dir=local, shared_every=2)
    if mode == "save":
        with Checkpointer(shared, comm, **every) as checkpoints:
            for step in map(int, steps):
                save(checkpoints, step, comm)
                time.sleep(0.05)  # "compute" while the background write goes on
    elif mode == "load":
        with Checkpointer(shared, comm, **every) as checkpoints:
            restored = checkpoints.load(int(steps[0]) if steps else None)
            check(restored, restored.step, comm)
            if comm.rank == 0:
                print(f"restored step {restored.step} from {restored.sources}")
    elif mode == "delta":
        with Checkpointer(shared, comm, keep=1, local_dir=local, delta=True, full_every=4) as checkpoints:
            for step in (101, 102, 103):
                save(checkpoints, step, comm)
        if comm.rank == 0:
            print("delta saved")
    elif mode == "fail-async":
        checkpoints = Checkpointer(shared, comm, background=True)
        save(checkpoints, 1, comm)
        checkpoints.wait()
        comm.Barrier()
        if comm.rank == 0:
            os.rename(shared, shared + ".moved")
            Path(shared).write_text("not a directory")
        comm.Barrier()
        save(checkpoints, 2, comm)
        try:
            checkpoints.wait()
        except CheckpointError as error:
            assert "level-3 save of step 2 failed" in str(error), error
            print(f"rank {comm.rank} saw: {str(error)[:60]}")
        else:
            raise AssertionError("a failed background save went unnoticed")
    elif mode == "no-close":
        checkpoints = Checkpointer(shared, comm, background=True)
        if comm.rank == 0:
            Path(shared, "step-00000001.h5.tmp").mkdir()  # the level-3 temporary file cannot be created
        comm.Barrier()
        save(checkpoints, 1, comm)
    elif mode == "mismatch":
        with Checkpointer(shared, comm) as checkpoints:
            try:
                checkpoints.save(1, sharded={"x": np.zeros((2, 3), np.float32 if comm.rank == 1 else np.float64)})
            except ValueError as error:
                assert "ranks disagree on the step, array names, dtypes or row shapes" in str(error), error
                print(f"rank {comm.rank} refused")
    elif mode == "kill":
        checkpoints = Checkpointer(shared, comm, local_dir=local, background=False)
        save(checkpoints, 1, comm)
        checkpoints.background = True
        big = np.random.default_rng(0).standard_normal((1 << 22, 4))  # 128 MiB: the write takes a while
        save(checkpoints, 2, comm, rows=len(big), x=big)
        if comm.rank == 1:  # tell the test whom to kill, now that the background write is under way
            Path(shared, "victim.tmp").write_text(str(os.getpid()))
            os.rename(Path(shared, "victim.tmp"), Path(shared, "victim.pid"))
        time.sleep(60)
        raise AssertionError("not killed")


mpiscale.run(main)
