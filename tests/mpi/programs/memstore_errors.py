"""Bad input to the memory store: every rank raises the same error, and nothing changes.

Each case is given on the last rank only; the others pass good batches, so a
store that checked only locally would hang in the exchange or change state.
"""

import numpy as np

import mpiscale
from mpiscale.memstore import MemoryStore


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
    try:
        await store.upsert(ids[:2], {"strength": np.array([0.1, np.inf if last else 0.2]), "quality": np.ones(2)})
    except ValueError as error:
        assert "strength: value 1 is inf" in str(error)
    else:
        raise AssertionError("an infinite strength was stored")
    await store.reinforce(ids[:2], np.array([0.25, 0.75], np.float32), iteration=3)  # still usable
    found, table = await store.lookup(ids[:2])
    assert found.all() and table[:, 0].tolist() == [0.75, 1.0] and table[:, 2].tolist() == [3.0, 3.0]
    if system.rank == 0:
        print(f"memstore errors ok: {system.size} ranks")


mpiscale.run(main)
