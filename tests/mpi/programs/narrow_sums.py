"""16-bit sums on the wire (kernels.halves.SumOfBits) through the hierarchical allreduce.

Each rank holds float32 values; the sum of their 16-bit patterns must be the
exact sum of those 16-bit values rounded once (on one node: the float32 sum of
a few 16-bit values is exact, so the result is the correctly rounded sum), or
within one rounding per stage across nodes; the same bits on every rank; and a
float32 buffer must be refused.
"""

import numpy as np

import mpiscale
from mpiscale.kernels.halves import SumOfBits, from_bits, to_bits

EPSILON = {"float16": 2.0**-10, "bfloat16": 2.0**-7}


async def main(system) -> None:
    count = 100_003  # not divisible by any rank count: uneven blocks
    everyone = np.random.default_rng(7).uniform(-4, 4, (system.size, count)).astype(np.float32)
    for kind, eps in EPSILON.items():
        inputs = from_bits(to_bits(everyone, kind), kind).reshape(everyone.shape).astype(np.float64)
        exact = inputs.sum(axis=0)  # the 16-bit inputs, added exactly
        bits = to_bits(everyone[system.rank], kind)
        await system.hierarchy.allreduce(bits, op=SumOfBits(kind), out=bits)
        result = from_bits(bits, kind).astype(np.float64)
        if system.hierarchy.node_count == 1:
            expected = from_bits(to_bits(exact.astype(np.float32), kind), kind)
            assert np.array_equal(result, expected), (kind, float(np.abs(result - expected).max()))
        else:
            error = np.abs(result - exact)
            assert (error <= 2 * eps * np.abs(inputs).sum(axis=0)).all(), (kind, float(error.max()))
        every = await system.world.allgather(bits)
        assert (every == every[0]).all(), f"{kind}: ranks differ"
    try:
        await system.hierarchy.allreduce(everyone[system.rank], op=SumOfBits("float16"))
    except TypeError as error:
        assert "adds 16-bit patterns (uint16)" in str(error)
    else:
        raise AssertionError("a float32 buffer was summed as 16-bit patterns")
    if system.rank == 0:
        print(f"narrow sums ok: {system.size} ranks")


mpiscale.run(main)
