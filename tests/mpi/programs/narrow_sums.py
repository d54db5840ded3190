"""16-bit sums on the wire (sum_float16, sum_bfloat16) through the world communicator and the hierarchy.

Each rank holds float32 values; the sums of their 16-bit patterns must be
within the 16-bit rounding of the exact float32 sum (one rounding per addition),
the same bits on every rank, and a float32 buffer must be refused.
"""

import numpy as np

import mpiscale
from mpiscale.runtime import bfloat16_bits, bfloat16_values, float16_bits, float16_values

CODECS = {"float16": (float16_bits, float16_values, 2.0**-10), "bfloat16": (bfloat16_bits, bfloat16_values, 2.0**-7)}


async def main(system) -> None:
    count = 100_003  # not divisible by any rank count: uneven blocks
    everyone = np.random.default_rng(7).uniform(-4, 4, (system.size, count)).astype(np.float32)
    exact = everyone.astype(np.float64).sum(axis=0)
    bound = np.abs(everyone).astype(np.float64).sum(axis=0)  # each addition rounds by at most eps * partial sum
    for kind, (encode, decode, eps) in CODECS.items():
        for path in ("world", "hierarchy"):
            bits = encode(everyone[system.rank])
            if path == "world":
                await system.world.allreduce(bits, op=f"sum_{kind}", out=bits)
            else:
                await system.hierarchy.allreduce(bits, op=f"sum_{kind}", out=bits)
            total = decode(bits).astype(np.float64)
            error = np.abs(total - exact)
            assert (error <= eps * system.size * bound + 1e-30).all(), (kind, path, float(error.max()))
            every = await system.world.allgather(bits)
            assert (every == every[0]).all(), f"{kind} via {path}: ranks differ"
    try:
        await system.hierarchy.allreduce(everyone[system.rank], op="sum_float16")
    except TypeError as error:
        assert "pass uint16" in str(error)
    else:
        raise AssertionError("a float32 buffer was summed as 16-bit patterns")
    if system.rank == 0:
        print(f"narrow sums ok: {system.size} ranks")


mpiscale.run(main)
