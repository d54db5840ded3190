"""The memory store on N ranks against a plain numpy model of the same workload, bit for bit.

usage: memstore_invariance.py RECORDS ITERATIONS [DIRECTORY [KILL_AT]]
The workload depends only on the seed: the global batches are split over the
ranks by position, so every world size runs the same global workload. Rank 0
keeps the numpy model (arrays sorted by id) and checks, every iteration, the
aggregate (count, exact sum, maximum, histogram) and the top-k; at the end
every record's columns, and lookups of stored and missing ids. It prints a
digest of everything, which the test compares across world sizes.

With DIRECTORY the store is durable (its checkpoints there, its logs and
shards in DIRECTORY/local, by node): each step of the workload is a commit,
with a checkpoint every 6 commits, and a rerun
recovers and goes on from the commit it reached. With KILL_AT, the last rank
applies step KILL_AT and is killed before committing it (SIGKILL), and the job
fails. The digest then covers the iterations run after the recovery.
"""

import hashlib
import math
import os
import signal
import sys

import numpy as np

import mpiscale
from mpiscale.memstore import Durability, MemoryStore
from mpiscale.ranks import rank_rows

K, BINS, RATE = 10, 16, np.float32(0.01)


class Model:
    """The store as one numpy table sorted by id."""

    def __init__(self) -> None:
        self.ids = np.empty(0, np.int64)
        self.columns = {name: np.empty(0, np.float32) for name in ("strength", "quality", "weight")}
        self.columns["touched"] = np.empty(0, np.int64)

    def upsert(self, ids, values) -> None:
        last = {int(i): n for n, i in enumerate(ids)}  # the last occurrence wins
        for i, n in sorted(last.items()):
            at = np.searchsorted(self.ids, i)
            if at < len(self.ids) and self.ids[at] == i:
                for name in ("strength", "quality", "weight"):
                    self.columns[name][at] = values[name][n]
            else:
                self.ids = np.insert(self.ids, at, i)
                for name in self.columns:
                    value = values[name][n] if name != "touched" else 0
                    self.columns[name] = np.insert(self.columns[name], at, value)

    def delete(self, ids) -> None:
        keep = ~np.isin(self.ids, ids)
        self.ids = self.ids[keep]
        self.columns = {name: column[keep] for name, column in self.columns.items()}

    def reinforce(self, ids, deltas, iteration) -> None:
        sums: dict[int, np.float32] = {}
        for i, d in zip(ids.tolist(), deltas):  # position order
            sums[i] = np.float32(sums[i] + d) if i in sums else np.float32(d)
        for i, d in sums.items():
            at = np.searchsorted(self.ids, i)
            s = self.columns["strength"]
            s[at] = min(max(np.float32(s[at] + d), np.float32(0)), np.float32(1))
            self.columns["touched"][at] = iteration

    def iterate(self):
        s = self.columns["strength"]
        s[:] = np.clip((s - RATE).astype(np.float32), 0, 1)
        q = self.columns["quality"]
        bins = np.clip(((q.astype(np.float64) - 0.0) * BINS).astype(np.int64), 0, BINS - 1)
        order = np.lexsort((self.ids, -q.astype(np.float64)))[:K]
        return len(q), math.fsum(q.tolist()), float(q.max()), np.bincount(bins, minlength=BINS), self.ids[order]


def workload(records: int, iterations: int):
    rng = np.random.default_rng(42)
    ids = rng.choice(2**62, records, replace=False).astype(np.int64)
    yield "upsert", ids, _values(rng, records)
    for iteration in range(iterations):
        picked = rng.choice(ids, max(1, records // 50))  # with repeats: combined in position order
        yield "reinforce", picked, rng.normal(0, 0.1, len(picked)).astype(np.float32), iteration
        if iteration % 4 == 1:
            fresh = rng.choice(2**62, 20).astype(np.int64)
            again = np.concatenate([rng.choice(ids, 30), fresh, fresh[:5]])  # overwrites and new ids, repeated
            yield "upsert", again, _values(rng, len(again))
            ids = np.union1d(ids, fresh)
        if iteration == 5:
            gone = np.concatenate([rng.choice(ids, 40, replace=False), [3, 5]])  # two that were never stored
            yield "delete", gone
            ids = np.setdiff1d(ids, gone)
        yield "iterate", iteration


def _values(rng, count):
    quality = rng.random(count).astype(np.float32)
    quality[::7] = quality[0]  # ties, broken by id in the ranking
    return {"strength": rng.random(count).astype(np.float32), "quality": quality,
            "weight": rng.normal(size=count).astype(np.float32)}  # fmt: skip


def mine(array, system):
    lo, hi = rank_rows(len(array), system.size, system.rank)
    return array[lo:hi]


async def main(system) -> None:
    records, iterations = int(sys.argv[1]), int(sys.argv[2])
    directory, kill_at = (sys.argv[3:] + [None, None])[:2]
    durable = None
    if directory:
        durable = Durability(f"{directory}/checkpoints", f"{directory}/local")
    store = MemoryStore(system, extra=("weight",), histogram_bins=BINS, durable=durable)
    done = 0
    if durable:
        recovered = await store.recover({"records": records})
        done = recovered.commits if recovered else 0
        if system.rank == 0:
            print(f"memstore recovered {done} commits" + (f" from {recovered.source}" if recovered else ""))
    model = Model() if system.rank == 0 else None
    digest = hashlib.sha256()
    for number, step in enumerate(workload(records, iterations), 1):
        if number <= done:  # recovered: only the model takes the step
            if model:
                model_step(model, step)
            continue
        await take(store, model, step, system, digest)
        if kill_at and number == int(kill_at) and system.rank == system.size - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if durable:
            await store.commit()
            if number % 6 == 0:
                await store.checkpoint()
    await check_final_state(store, model, system, digest)
    store.close()


def model_step(model, step):
    """One step of the workload on the model; an iteration's results."""
    kind, *args = step
    return model.iterate() if kind == "iterate" else getattr(model, kind)(*args)


async def take(store, model, step, system, digest) -> None:
    """One step of the workload on the store (and the model, on rank 0), checked against each other."""
    kind = step[0]
    if kind == "upsert":
        _, ids, values = step
        await store.upsert(mine(ids, system), {k: mine(v, system) for k, v in values.items()})
    elif kind == "delete":
        removed = await store.delete(mine(step[1], system))
        assert removed == 40, removed
    elif kind == "reinforce":
        _, ids, deltas, iteration = step
        await store.reinforce(mine(ids, system), mine(deltas, system), iteration)
    expected = model_step(model, step) if model else None
    if kind == "iterate":
        result = await store.iterate(RATE, k=K)
        digest.update(repr((result.count, result.total, result.maximum)).encode())
        digest.update(result.histogram.tobytes() + result.top_ids.tobytes() + result.top_quality.tobytes())
        if model:
            count, total, maximum, histogram, top = expected
            assert (result.count, result.total, result.maximum) == (count, total, maximum), (result, total)
            assert np.array_equal(result.histogram, histogram) and np.array_equal(result.top_ids, top)


async def check_final_state(store, model, system, digest) -> None:
    state = [store.partition.ids.copy()] + [store.partition.column(n).copy() for n in store.columns]
    from mpi4py import MPI

    every = MPI.COMM_WORLD.gather(state, root=0)
    probe = np.concatenate([model.ids[::97], np.array([7, 11], np.int64)]) if model else None
    probe = MPI.COMM_WORLD.bcast(probe, root=0)
    found, values = await store.lookup(mine(probe, system))
    found_all = MPI.COMM_WORLD.gather((found, values), root=0)
    if model:
        ids = np.concatenate([part[0] for part in every])
        order = np.argsort(ids)
        assert np.array_equal(ids[order], model.ids)
        for j, name in enumerate(store.columns, 1):
            column = np.concatenate([part[j] for part in every])[order]
            assert np.array_equal(column.view(np.uint32), model.columns[name].view(np.uint32)), name
            digest.update(column.tobytes())
        found = np.concatenate([f for f, _ in found_all])
        values = np.concatenate([v for _, v in found_all])
        stored = np.isin(probe, model.ids)
        assert np.array_equal(found, stored)
        at = np.searchsorted(model.ids, probe[stored])
        for j, name in enumerate(store.columns):
            assert np.array_equal(values[stored, j], model.columns[name][at]), name
        print(f"memstore ok: {system.size} ranks, {len(model.ids)} records, digest {digest.hexdigest()[:16]}")


mpiscale.run(main)
