"""The runtime demo: actors on every rank pass tokens around a ring, then collectives.

Shows, in one short job: a group of actors (one per rank), ``ask`` and
``tell`` across ranks, a remote ``spawn``, an allreduce over all ranks and the
two-level (node, leaders) allreduce.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time

import numpy as np

from .runtime import Actor, ActorGroup, ActorSystem, run

log = logging.getLogger(__name__)


class RingNode(Actor):
    """Forwards a token to the next rank's node until it has visited ``laps`` laps."""

    def __init__(self, group: ActorGroup, laps: int) -> None:
        self.group = group
        self.laps = laps
        self.finished: list[list[int]] = []

    async def token(self, path: list[int]) -> None:
        path.append(self.ref.rank)
        if len(path) == self.laps * self.group.size:
            origin = self.group[path[0]]
            origin.tell("done", path)
        else:
            self.group[(self.ref.rank + 1) % self.group.size].tell("token", path)

    def done(self, path: list[int]) -> None:
        self.finished.append(path)

    def finished_tokens(self) -> list[list[int]]:
        return self.finished


class Greeter(Actor):
    """Spawned remotely by rank 0 to show that an actor can be placed on any rank."""

    def hello(self, name: str) -> str:
        return f"hello {name}, from rank {self.ref.rank} on {self.system.host}"


async def demo(system: ActorSystem, tokens: int = 100, laps: int = 3) -> dict:
    """Run the demo on every rank; returns rank 0's summary (others return their part)."""
    start = time.perf_counter()
    ring = await system.spawn_group(RingNode, ActorGroup("ring", system.size), laps, name="ring")
    me = ring[system.rank]
    for _ in range(tokens):
        me.tell("token", [])
    while len(await me.ask("finished_tokens")) < tokens:
        await asyncio.sleep(0.001)  # the ring runs meanwhile
    paths = await me.ask("finished_tokens")
    expected = [(system.rank + i) % system.size for i in range(laps * system.size)]
    assert all(p == expected for p in paths), "a token took a wrong path"
    hops = await system.world.allreduce(np.array([len(paths) * laps * system.size], dtype=np.int64))
    ring_s = time.perf_counter() - start

    greeting = None
    if system.rank == 0 and system.size > 1:
        greeter = await system.spawn(Greeter, name="greeter", rank=system.size - 1)
        greeting = await greeter.ask("hello", "rank 0", timeout=30)

    values = np.arange(4, dtype=np.float64) + system.rank
    flat = await system.world.allreduce(values)
    two_level = await system.hierarchy.allreduce(values)
    expected_sum = sum(np.arange(4) + r for r in range(system.size))
    assert np.allclose(flat, expected_sum) and np.allclose(two_level, expected_sum)
    summary = {
        "ranks": system.size,
        "nodes": system.hierarchy.node_count,
        "token_hops": int(hops[0]),
        "hops_per_s": float(hops[0] / ring_s),
        "allreduce": flat.tolist(),
        "greeting": greeting,
    }
    if system.rank == 0:
        log.info(
            "ring: %d tokens x %d laps on %d ranks: %d hops in %.2fs (%.0f hops/s)",
            tokens * system.size,
            laps,
            system.size,
            summary["token_hops"],
            ring_s,
            summary["hops_per_s"],
        )
        log.info("remote spawn: %s", greeting)
        log.info(
            "allreduce over %d ranks: %s; two-level over %d nodes: %s",
            system.size,
            flat.tolist(),
            system.hierarchy.node_count,
            two_level.tolist(),
        )
    return summary


def command(args: argparse.Namespace) -> int:
    """``mpiscale demo``: the ring on every rank; rank 0 (or a lone process) prints what it saw."""
    summary = run(lambda system: demo(system, tokens=args.tokens, laps=args.laps))
    if summary.get("greeting") is not None or summary["ranks"] == 1:
        print(
            f"demo ok: {summary['ranks']} ranks, {summary['token_hops']} token hops, allreduce {summary['allreduce']}"
        )
    return 0
