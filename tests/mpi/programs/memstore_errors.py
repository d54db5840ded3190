"""Bad input to the memory store: every rank raises the same error, and nothing changes.

Each case is given on the last rank only; the others pass good batches, so a
store that checked only locally would hang in the exchange or change state.
"""

import shutil
import tempfile

import numpy as np

import mpiscale
from mpiscale.memstore import Durability, MemoryStore


async def main(system) -> None:
    store = MemoryStore(system)
    last = system.rank == system.size - 1
    ids = np.arange(system.rank * 100, system.rank * 100 + 100, dtype=np.int64)
    values = {"strength": np.full(100, 0.5, np.float32), "quality": np.linspace(0, 1, 100, dtype=np.float32)}
    assert await store.upsert(ids, values) == 100 * system.size

    def snapshot():
        return [store.partition.ids.copy()] + [store.partition.column(n).copy() for n in store.columns]

    before = snapshot()
    cases = {
        "non-finite delta": (ids[:3], np.array([0.1, np.nan if last else 0.1, 0.1]), "deltas: value 1 is nan"),
        "a delta float32 cannot hold": (
            ids[:2],
            np.array([0.1, 1e39 if last else 0.1]),
            "deltas: value 1 is 1e+39, past float32's largest",
        ),
        "unknown id": (np.array([10**12]) if last else ids[:1], np.array([0.1]), "ids are not stored"),
        "id beyond int64": (np.array([2**63], np.uint64) if last else ids[:1], np.array([0.1]), "must fit in int64"),
        "float ids": (np.array([1.5]) if last else ids[:1], np.array([0.1]), "ids must be integers"),
    }
    for name, (bad_ids, deltas, expected) in cases.items():
        try:
            await store.reinforce(bad_ids, deltas, iteration=1)
        except ValueError as error:
            assert expected in str(error), (name, str(error))
        else:
            raise AssertionError(f"{name} was accepted")
        after = snapshot()
        assert all(np.array_equal(a, b) for a, b in zip(before, after)), f"{name} changed the store"
    try:  # a float64 holds 2^53 + 1 as 2^53: it was stored, and read back one less
        await store.reinforce(ids[:1], np.array([0.1]), iteration=2**53 + 1)
    except ValueError as error:
        assert "the iteration must be an integer from 0 to 2^53" in str(error), str(error)
    else:
        raise AssertionError("iteration 2^53 + 1 was accepted")
    assert all(np.array_equal(a, b) for a, b in zip(before, snapshot())), "a refused iteration changed the store"
    try:
        await store.upsert(ids[:2], {"strength": np.array([0.1, np.inf if last else 0.2]), "quality": np.ones(2)})
    except ValueError as error:
        assert "strength: value 1 is inf" in str(error)
    else:
        raise AssertionError("an infinite strength was stored")
    upserts = {
        "unknown column": ({"strength": values["strength"], "quality": values["quality"]}
                           | ({"qualty": values["quality"]} if last else {}), "not columns of this store: qualty"),
        "touched given": (values | ({"touched": np.ones(100)} if last else {}), "touched is kept by the store"),
        "2-D values": (values | ({"quality": values["quality"].reshape(50, 2)} if last else {}),
                       "quality: one value per id, got an array of shape (50, 2)"),
        "strength above 1": (values | ({"strength": np.full(100, 1.5)} if last else {}),
                             "strength: value 0 is 1.5; strengths are in [0, 1]"),
        "object values": (values | ({"quality": np.array([object()] * 100)} if last else {}),
                          "quality: values must be numbers"),
    }  # fmt: skip
    for name, (given, expected) in upserts.items():
        await refused(store.upsert(ids, given), expected, name)
        assert all(np.array_equal(a, b) for a, b in zip(before, snapshot())), f"{name} changed the store"
    nan = float("nan")
    iterations = {
        "nan rate": (nan if last else 0.1, 5, "the rate must be a number in [0, 1]"),
        "negative rate": (-0.1, 5, "the rate must be a number in [0, 1]; got -0.1 on every rank"),
        "rate above 1": (1.5, 5, "the rate must be a number in [0, 1]"),
        "infinite rate": (float("inf"), 5, "the rate must be a number in [0, 1]"),
        "k of -1": (0.1, -1, "k must be an integer >= 0; got -1 on every rank"),
        "fractional k": (0.1, 2.5 if last else 2, "k must be an integer >= 0"),
    }
    if system.size > 1:
        iterations |= {
            "rates that differ": (0.2 if last else 0.1, 5, "every rank must give the same rate; got rank 0: 0.1"),
            "k that differs": (0.1, 6 if last else 5, "every rank must give the same k"),
        }
    for name, (rate, k, expected) in iterations.items():
        await refused(store.iterate(rate, k), expected, name)
        if "rate" in name:  # the same on every rank: decay alone is refused too
            await refused(store.decay(rate), "decay: ", name)
        assert all(np.array_equal(a, b) for a, b in zip(before, snapshot())), f"{name} changed the store"
    await store.reinforce(ids[:2], np.array([0.25, 0.75], np.float32), iteration=3)  # still usable
    found, table = await store.lookup(ids[:2])
    assert found.all() and table[:, 0].tolist() == [0.75, 1.0] and table[:, 2].tolist() == [3.0, 3.0]
    await edges(system)
    await durable_refusals(system)
    if system.rank == 0:
        print(f"memstore errors ok: {system.size} ranks")


async def refused(call, expected: str, name: str, kind: type[Exception] = ValueError) -> None:
    try:
        await call
    except (kind, TypeError) as error:
        assert expected in str(error), (name, str(error))
    else:
        raise AssertionError(f"{name} was accepted")


async def edges(system) -> None:
    """The largest id ranks like any other; k beyond the store gives every record; huge qualities bin at the ends."""
    store = MemoryStore(system, histogram_bins=4)
    mine = np.array([2**63 - 1, 7, 8], np.int64) if system.rank == 0 else np.empty(0, np.int64)
    quality = np.array([0.9, 1e30, -1e30], np.float32)[: len(mine)]
    await store.upsert(mine, {"strength": np.full(len(mine), 0.5), "quality": quality})
    result = await store.iterate(0.0, k=10)
    assert result.top_ids.tolist() == [7, 2**63 - 1, 8], result.top_ids
    assert result.histogram.tolist() == [1, 0, 0, 2], result.histogram  # -1e30 first; 0.9 and 1e30 last
    empty = await MemoryStore(system).iterate(0.1, k=5)
    assert empty.count == 0 and len(empty.top_ids) == 0


async def durable_refusals(system) -> None:
    """A durable store refuses changes before recover() without applying them, and notes it cannot log."""
    directory = await system.world.bcast(tempfile.mkdtemp() if system.rank == 0 else None)
    store = MemoryStore(system, durable=Durability(directory))
    ids = np.arange(system.rank * 10, system.rank * 10 + 10, dtype=np.int64)
    values = {"strength": np.full(10, 0.5), "quality": np.ones(10)}
    await refused(store.upsert(ids, values), "must recover() before it changes", "upsert before recover", RuntimeError)
    assert store.partition.size == 0
    await store.recover({"test": "errors"})
    await store.upsert(ids, values)
    last = system.rank == system.size - 1
    notes = {"mean": np.array([0.5]), "who": np.array(["x", object()], dtype=object) if last else np.array(["x"])}
    await refused(store.commit(notes), "note 'who' is of type object", "object notes")
    assert await store.commit({"mean": np.array([0.5])}) == 1
    store.close()
    await system.world.barrier()
    if system.rank == 0:
        shutil.rmtree(directory)


mpiscale.run(main)
