"""Data-parallel training that survives restarts on any number of ranks.

    launch/mpiscale-run -n 2 -- python examples/train_with_checkpoints.py run1 --epochs 2
    launch/mpiscale-run -n 4 -- python examples/train_with_checkpoints.py run1 --epochs 4   # resumes at epoch 2

Rank 0 of the first job writes a synthetic regression dataset (sharded HDF5);
every rank reads its share of each shuffled global batch, the gradients are
summed with an awaitable allreduce, and a checkpoint is saved in the background
after each epoch. The global batches depend only on (seed, epoch), so the
resumed run follows the same trajectory as an uninterrupted one.
"""

import argparse
from pathlib import Path

import numpy as np

import mpiscale
from mpiscale.io import BatchReader, Checkpointer, SampleRandom, rank_rows, write_dataset

SAMPLES, FEATURES, BATCH, SEED = 2000, 8, 64, 7


def make_dataset(path: Path, comm) -> None:
    """Every rank writes its block of a synthetic dataset y = X w + noise."""
    start, stop = rank_rows(SAMPLES, comm.size, comm.rank)
    x = SampleRandom(SEED).normal(0, range(start, stop), FEATURES)
    noise = SampleRandom(SEED).normal(0, range(start, stop), 1, stream=1)[:, 0]
    y = x @ np.arange(1.0, FEATURES + 1) + 0.01 * noise
    write_dataset(path, {"x": x, "y": y}, comm)


async def main(system) -> None:
    options = argparse.ArgumentParser()
    options.add_argument("workdir", type=Path)
    options.add_argument("--epochs", type=int, default=3)
    options.add_argument("--lr", type=float, default=0.05)
    args = options.parse_args()
    comm = system.world  # the io calls take the runtime's communicator (or an mpi4py one)
    if system.rank == 0:
        args.workdir.mkdir(parents=True, exist_ok=True)
    await comm.barrier()
    data = args.workdir / "data.h5"
    if not data.exists():
        make_dataset(data, comm)
    with Checkpointer(args.workdir / "checkpoints", comm, keep=2) as checkpoints:
        restored = checkpoints.load()
        weights = restored.replicated["weights"] if restored else np.zeros(FEATURES)
        first = restored.meta["epoch"] + 1 if restored else 0
        if restored and system.rank == 0:
            print(f"resumed at epoch {first} on {system.size} ranks")
        with BatchReader(data, ["x", "y"], BATCH, comm, shuffle=True, seed=SEED) as reader:
            for epoch in range(first, args.epochs):
                loss = np.zeros(1)
                for batch in reader.epoch(epoch):
                    x, y = batch.data["x"], batch.data["y"]
                    error = x @ weights - y
                    gradient = np.append(x.T @ error, [len(y), error @ error])  # sums over my share
                    total = await system.world.allreduce(gradient)
                    weights = weights - args.lr * total[:FEATURES] / total[FEATURES]
                    loss += total[FEATURES + 1]
                checkpoints.save(epoch, replicated={"weights": weights}, meta={"epoch": epoch})
                if system.rank == 0:
                    print(f"epoch {epoch}: mean squared error {loss[0] / SAMPLES:.6f}")
    if system.rank == 0:
        print("weights " + " ".join(f"{w:.12f}" for w in weights))


mpiscale.run(main)
