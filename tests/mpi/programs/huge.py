"""A message larger than 2 GiB (MPI-3 counts are 32-bit) arrives intact."""

import numpy as np

import mpiscale

SIZE = 2**31 + 4099  # just over 2 GiB, not a multiple of anything convenient
MARKS = np.array([0, 1, 2**20, 2**31 - 1, 2**31, SIZE - 1])


class Checker(mpiscale.Actor):
    def check(self, data: np.ndarray) -> tuple:
        return data.nbytes, data[MARKS].tolist()


async def main(system):
    checker = await system.spawn_group(Checker, name="checker")
    if system.rank == 0:
        data = np.zeros(SIZE, dtype=np.uint8)
        data[MARKS] = np.arange(1, len(MARKS) + 1)
        nbytes, marks = await checker[1].ask("check", data)
        assert nbytes == SIZE and marks == list(range(1, len(MARKS) + 1)), (nbytes, marks)
        print(f"huge ok: {nbytes} bytes")


mpiscale.run(main)
