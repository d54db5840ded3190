"""Every rank generates its slice; gathered, the values equal one process generating all."""

import numpy as np

import mpiscale
from mpiscale.io import SampleRandom

SAMPLES = 10_007  # not divisible by the world size


async def main(system):
    streams = SampleRandom(99)
    for epoch in (0, 5):
        mine = np.array_split(np.arange(SAMPLES), system.size)[system.rank]
        rows = streams.uniform(epoch, mine, 5)
        everything = await system.world.gather(np.ascontiguousarray(np.pad(rows, ((0, SAMPLES - len(rows)), (0, 0)))))
        counts = await system.world.gather(np.array([len(rows)]))
        if system.rank == 0:
            joined = np.concatenate([block[:n] for block, (n,) in zip(everything, counts)])
            assert np.array_equal(joined, streams.uniform(epoch, range(SAMPLES), 5)), "depends on the world size"
    # A shuffled assignment of samples to ranks gives the same values too.
    order = np.random.default_rng(3).permutation(SAMPLES)
    mine = order[system.rank :: system.size]
    assert np.array_equal(streams.uniform(1, mine, 2), streams.uniform(1, range(SAMPLES), 2)[mine])
    if system.rank == 0:
        print(f"sample random ok on {system.size} ranks")


mpiscale.run(main)
