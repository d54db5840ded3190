"""Collectives some rank never enters, or enters as another: one report ends the job (MPISCALE_COLLECTIVE_CHECK_S)."""

import asyncio
import sys
import time

import numpy as np

import mpiscale


async def main(system):
    scenario = sys.argv[1]
    last = system.size - 1
    ones = np.ones(4)
    await system.world.barrier()
    if scenario == "left-main":
        if system.rank == last:
            return  # forgets the final allreduce the others wait in
        await system.world.allreduce(ones)
    elif scenario == "left-main-hierarchical":
        if system.rank != last:
            await system.hierarchy.allreduce(ones)
    elif scenario == "other-operation":
        if system.rank == 0:
            await system.world.barrier()
        else:
            await system.world.allreduce(ones)
    elif scenario == "two-communicators":  # each waits in a collective of a communicator the other never enters
        if system.rank == 0:
            await system.hierarchy.allreduce(ones)
        else:
            await system.world.allreduce(ones)
    elif scenario == "world-against-node-barrier":
        if system.rank == 0:
            await system.world.barrier()
        else:
            await system.node.barrier()
    elif scenario == "agree-against-allreduce":  # the lengths an agreement exchanges met another's signature
        if system.rank == 0:
            await system.world.agree(None, "a check")
        else:
            await system.world.allreduce(ones)
    elif scenario == "barrier-against-lookup":
        from mpiscale.memstore import MemoryStore

        store = MemoryStore(system)
        if system.rank == 0:
            await system.world.barrier()
        else:
            await store.lookup(np.arange(3))
    elif scenario == "hierarchical-shapes":  # the last rank passes one value more
        await system.hierarchy.allreduce(np.ones(4 + (system.rank == system.size - 1)))
    elif scenario == "slow-rank":  # late, busy outside the loop, but it does enter: no report, the right sum
        if system.rank == last:
            time.sleep(3 * system.config.collective_check_s)
        total = await system.world.allreduce(ones)
        assert np.array_equal(total, ones * system.size), total
        await system.world.barrier()
        if system.rank == 0:
            print(f"slow rank ok on {system.size} ranks", flush=True)
    elif scenario == "slow-leaves-late":  # one rank works on alone after the last collective: a normal end
        if system.rank == 0:
            await asyncio.sleep(3 * system.config.collective_check_s)
            print(f"late finish ok on {system.size} ranks", flush=True)
    elif scenario == "blocking-on-two-communicators":  # both hold their loops, in calls the other never makes
        from mpiscale.runtime import blocking_barrier

        copy = system.world.comm.Dup()
        comm = system.world.comm if system.rank == 0 else copy
        blocking_barrier(comm, "one of two", "rank waits for the others")
    elif scenario == "blocking-on-two-pairs":  # rank 0 meets rank 1, then the late rank 2, on unnamed communicators
        from mpiscale.runtime import blocking_barrier

        first = system.world.comm.Split(int(system.rank == 2))  # ranks 0 and 1
        second = system.world.comm.Split(int(system.rank == 1))  # ranks 0 and 2
        if system.rank == 2:
            await asyncio.sleep(3 * system.config.collective_check_s)
        if system.rank != 2:
            blocking_barrier(first, "first pair", "rank waits for its first pair")
        if system.rank != 1:
            blocking_barrier(second, "second pair", "rank waits for its second pair")
        if system.rank == 0:
            print("two pairs ok", flush=True)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    mpiscale.run(main)
