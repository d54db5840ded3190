"""A compiled plan's overhead: a 16-node graph run sequentially, as one remote call per node, and compiled.

Each node does ``work`` of compute (a timed spin: 1 ms, and 0 for the bare
overhead) and passes on a small tensor (16 x 64 float32, 4 KiB). Measured
between the same 2 ranks, per batch:

- **sequential**: every node in one process, in order: the floor;
- **naive asks**: rank 0 drives the graph, asking the rank that holds each
  node (alternately 0 and 1) to compute it and send the value back: one
  remote call per node, every edge through the driver (plain actors, as a
  graph engine of remote calls does it);
- **compiled, one batch at a time, nodes alternating**: every one of the 15
  edges crosses ranks; ``(compiled - sequential) / 15`` is the overhead of a
  cross-rank edge;
- **compiled, pipelined**: the placement ``place`` chooses (two halves of
  the chain) with 4 (the job's default on 2 ranks) and 16 batches in
  flight, per batch: the throughput against the floor.

- **Ray** (where it installs): the same chain on two Ray actors, nodes
  alternating, as one remote call per node and as Ray's compiled graph
  (``experimental_compile``), run by rank 0 alone after the rest.

Run it under ``launch/mpiscale-run -n 2``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from functools import partial

import numpy as np

from ..circuits.graph import CompiledGraph, Graph, Node, place
from ..circuits.plan import INPUT
from ..runtime import Actor, ActorGroup, ActorSystem, run
from .report import table, write_json

NODES = 16
IN_FLIGHT = (4, 16)  # batches at once: the job's default on 2 ranks (twice the ranks), and more
ROWS, WIDTH = 16, 64


def _spin(seconds: float, inputs: list) -> np.ndarray:
    """A node's compute: ``seconds`` of work, then its small value."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
    return inputs[0] + 1


def chain(work: float) -> Graph:
    """16 nodes, each taking the one before (the first takes the data rows)."""
    nodes = {}
    for index in range(NODES):
        name = f"n{index:02d}"
        source = INPUT if index == 0 else f"n{index - 1:02d}"
        nodes[name] = Node(name, (source,), WIDTH, 1, partial(_spin, work))
    return Graph(nodes, [f"n{NODES - 1:02d}"], WIDTH, np.dtype(np.float32))


class NodeHost(Actor):
    """Computes the nodes of a graph a driver asks it for (the naive way)."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph

    def compute(self, name: str, inputs: list) -> object:
        return self.graph.nodes[name].compute(inputs)


async def _per_batch(system: ActorSystem, batches: int, run) -> float:
    """Median seconds per batch of ``run(batch)`` on every rank (rank 0's clock, after a barrier)."""
    await system.world.barrier()
    times = []
    for batch in range(batches):
        start = time.perf_counter()
        await run(batch)
        await system.world.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


async def _measure(system: ActorSystem, work: float, batches: int, tag: str) -> dict:
    graph = chain(work)
    rows = np.ones((ROWS, WIDTH), np.float32)
    sequential = 0.0
    if system.rank == 0:
        graph.run(rows)
        times = []
        for _ in range(batches):
            start = time.perf_counter()
            graph.run(rows)
            times.append(time.perf_counter() - start)
        sequential = statistics.median(times)
    alternate = {name: index % system.size for index, name in enumerate(graph.nodes)}

    hosts: ActorGroup = await system.spawn_group(NodeHost, graph, name=f"graph-hosts-{tag}")

    async def naive(batch: int) -> None:
        if system.rank != 0:
            return
        values: dict[str, object] = {INPUT: rows}
        for node in graph.nodes.values():
            inputs = [values[source] for source in node.inputs]
            values[node.name] = await hosts[alternate[node.name]].ask("compute", node.name, inputs)

    alternating = CompiledGraph(system, graph, alternate)
    await alternating.start(f"graph-alternating-{tag}")

    async def compiled_alternating(batch: int) -> None:
        await alternating.run_batch(batch, rows if alternating.reads_input else None)

    balanced = CompiledGraph(system, graph, place(graph, system.size, "bench"))
    await balanced.start(f"graph-balanced-{tag}")
    next_batch = 0

    async def pipelined(in_flight: int, step: int) -> None:
        nonlocal next_batch
        first, next_batch = next_batch, next_batch + in_flight
        await asyncio.gather(*(balanced.run_batch(first + b, rows if balanced.reads_input else None)
                               for b in range(in_flight)))  # fmt: skip

    await _per_batch(system, 2, naive)  # warm-up
    result = {
        "work_s": work,
        "sequential_s": sequential,
        "naive_asks_s": await _per_batch(system, batches, naive),
        "compiled_alternating_s": await _per_batch(system, batches, compiled_alternating),
    }
    for in_flight in IN_FLIGHT:
        waves = max(2, batches // in_flight)
        result[f"compiled_pipelined_{in_flight}_s"] = (
            await _per_batch(system, waves, partial(pipelined, in_flight)) / in_flight
        )
    edges = NODES - 1
    result["edge_overhead_s"] = (result["compiled_alternating_s"] - sequential) / edges
    result["naive_overhead_per_node_s"] = (result["naive_asks_s"] - sequential) / NODES
    return result


def ray_peer(works: tuple[float, ...], batches: int) -> list[dict] | str:
    """The same chain as Ray actors on two worker processes (nodes alternating): one remote call per node, and
    Ray's compiled graph (``experimental_compile``); ms per batch. A string says why Ray could not run."""
    try:
        import ray
        from ray.dag import InputNode
    except ImportError:
        return "Ray is not installed (pip install ray, or the bench extra): its rows are left out"

    @ray.remote
    class Host:
        def compute(self, value: np.ndarray, work: float) -> np.ndarray:
            return _spin(work, [value])

    rows = np.ones((ROWS, WIDTH), np.float32)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        hosts = [Host.remote(), Host.remote()]  # type: ignore[attr-defined]
        results = []
        for work in works:
            with InputNode() as source:
                value = source
                for index in range(NODES):
                    value = hosts[index % 2].compute.bind(value, work)
            compiled = value.experimental_compile()

            def remote_calls(work: float = work) -> None:
                value = rows
                for index in range(NODES):
                    value = ray.get(hosts[index % 2].compute.remote(value, work))

            timings = {}

            def compiled_call(compiled=compiled) -> None:
                ray.get(compiled.execute(rows))

            for name, once in (("ray_compiled_s", compiled_call), ("ray_actors_s", remote_calls)):
                for _ in range(3):
                    once()
                times = []
                for _ in range(batches):
                    start = time.perf_counter()
                    once()
                    times.append(time.perf_counter() - start)
                timings[name] = statistics.median(times)
            compiled.teardown()
            results.append({"work_s": work, **timings})
        return results
    finally:
        ray.shutdown()


async def run_graph_bench(system: ActorSystem, json_path: str, quick: bool = False) -> dict | None:
    if system.size != 2:
        raise SystemExit(f"bench graph needs 2 ranks, got {system.size}: launch/mpiscale-run -n 2 -- mpiscale "
                         "bench graph")  # fmt: skip
    batches = 10 if quick else 40
    works = (0.0, 0.001)
    results = [await _measure(system, work, batches, f"w{index}") for index, work in enumerate(works)]
    peer = ray_peer(works, batches) if system.rank == 0 else None  # the other rank waits, asleep
    await system.world.barrier()
    if system.rank != 0:
        return None
    if isinstance(peer, str):
        print(peer)
    else:
        for result, ray_result in zip(results, peer or []):
            result.update(ray_result)
    rows = []
    for r in results:
        floor = r["sequential_s"]
        for engine, key in (("sequential (floor)", "sequential_s"), ("naive asks", "naive_asks_s"),
                            ("compiled, nodes alternating", "compiled_alternating_s"),
                            *((f"compiled, {n} batches in flight", f"compiled_pipelined_{n}_s")
                              for n in IN_FLIGHT),
                            ("Ray actors, one call per node", "ray_actors_s"),
                            ("Ray compiled graph", "ray_compiled_s")):  # fmt: skip
            if key in r:
                rows.append([f"{r['work_s'] * 1e3:g} ms", engine, r[key] * 1e3, f"{r[key] / floor:.2f}x"])
    print(f"a chain of {NODES} nodes passing {ROWS} x {WIDTH} float32 (4 KiB), 2 ranks; ms per batch")
    print(table(["work per node", "engine", "ms per batch", "vs floor"], rows))
    for r in results:
        print(f"work {r['work_s'] * 1e3:g} ms: a cross-rank edge costs {r['edge_overhead_s'] * 1e6:.1f} us compiled; "
              f"a node costs {r['naive_overhead_per_node_s'] * 1e6:.1f} us more as a remote call")  # fmt: skip
    record = {"nodes": NODES, "tensor_bytes": ROWS * WIDTH * 4, "results": results}
    write_json(json_path, "graph", system.size, record)
    return record


def command(args: argparse.Namespace) -> int:
    """``mpiscale bench ...``: the options parsed, the benchmark run, its table printed and its JSON written."""
    run(lambda system: run_graph_bench(system, args.json, quick=args.quick))
    return 0
