"""``circuits run --plan``: a composition plan compiled over the ranks, its outputs written as ``/outputs/NODE``.

Each step runs ``in_flight`` batches at once through the compiled graph
(:mod:`.graph`): every rank runs its nodes on each of them, a rank whose
nodes read the data reads the batch's rows itself, and the ranks pass values
along the graph's edges, so while one rank works on a batch's later nodes
another works on the next batch's first ones. The rank that holds an output
node writes its rows.
"""

from __future__ import annotations

import asyncio

import numpy as np

from ..io import DataFileError, fixed_strings
from ..runtime import ActorSystem
from ..words import counted
from .catalogue import Catalogue
from .config import CircuitsRunConfig
from .graph import CompiledGraph, Failed, build_graph, place
from .plan import load_plan
from .work import BatchRows, Inputs, Write


def plan_work(
    system: ActorSystem, config: CircuitsRunConfig, width: int, dtype: np.dtype, device: str = "cpu"
) -> PlanRun:
    """The plan of ``config`` checked against the catalogue and the data, placed over the job's ranks."""
    plan = load_plan(config.plan)
    with Catalogue(config.catalogue) as catalogue:
        graph = build_graph(plan, catalogue, width, dtype, verify=system.rank == 0, device=device)
        models = [model.path for model in catalogue.models]
    placement = place(graph, system.size, config.plan)
    compiled = CompiledGraph(system, graph, placement)
    return PlanRun(system, compiled, plan.sha256, models, config.in_flight or 2 * system.size)


class PlanRun:
    """A compiled plan; every rank runs its part of each of a step's batches."""

    def __init__(self, system: ActorSystem, compiled: CompiledGraph, sha256: str, models: list[str],
                 per_step: int) -> None:  # fmt: skip
        self.system, self.compiled, self.sha256, self.models, self.per_step = system, compiled, sha256, models, per_step
        self.graph = compiled.graph

    def layout(self, samples: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {f"outputs/{name}": ((samples, self.graph.nodes[name].width or 0), np.dtype(np.float32))
                for name in self.graph.outputs}  # fmt: skip

    def replicated(self) -> dict[str, np.ndarray]:
        placed = self.compiled.placement
        names = list(self.graph.nodes)
        tables = {"plan/nodes": fixed_strings(names), "plan/ranks": np.array([placed[n] for n in names], np.int64)}
        for node, circuits in self.graph.circuits.items():
            tables[f"plan/circuits/{node}"] = fixed_strings(circuits)
        return tables

    def what_changed(self, name: str) -> str | None:
        if name == "plan/ranks":
            return None  # the placement follows the job's ranks: a resumed run places the plan anew
        if name == "plan/nodes":
            return "the plan's nodes changed (the catalogue's models behind them, or the plan)"
        return f"the circuits node {name.rsplit('/', 1)[-1]!r} selects other circuits (the catalogue changed)"

    async def start(self) -> None:
        await self.compiled.start()

    async def step(self, batches: list[int], data: BatchRows, inputs: Inputs) -> tuple[list[Write], str | None]:
        def rows_of(batch: int) -> np.ndarray | Failed | None:
            if not self.compiled.reads_input:
                return None
            lo, hi = inputs.bounds(batch)
            try:
                rows = np.asarray(data.read(lo, hi)).reshape(hi - lo, self.graph.input_width)
            except DataFileError as error:  # rows this rank cannot read: the failure travels in place of the value
                return Failed(error.message)
            return rows.astype(np.float32) if rows.dtype.kind == "f" else rows

        results = await asyncio.gather(*(self.compiled.run_batch(b, rows_of(b)) for b in batches))
        failure = next((f for _, f in results if f is not None), None)
        writes: list[Write] = []
        for name in self.graph.outputs:
            width = self.graph.nodes[name].width or 0
            for slot in range(self.per_step):
                values = results[slot][0] if slot < len(batches) else {}
                lo, _ = inputs.bounds(batches[slot] if slot < len(batches) else None)
                rows = values.get(name, np.empty((0, width), np.float32))
                if failure is None and len(rows) and not np.isfinite(rows).all():
                    failure = f"sample {lo + int(np.flatnonzero(~np.isfinite(rows).all(axis=1))[0])} gives NaN or " \
                              f"infinity in output {name!r}: the data holds them, or the plan's values overflow " \
                              "float32 on it"  # fmt: skip
                writes.append((f"outputs/{name}", lo, np.asarray(rows, np.float32)))
        for slot in range(self.per_step):  # rank 0 numbers the rows
            batch = batches[slot] if slot < len(batches) and self.system.rank == 0 else None
            lo, hi = inputs.bounds(batch)
            writes.append(("sample_ids", lo, np.arange(lo, hi, dtype=np.int64)))
        return writes, failure

    def describe(self) -> str:
        placed = self.compiled.placement
        ranks = len(set(placed.values()))
        return (f"plan of {len(self.graph.nodes)} nodes on {counted(ranks, 'rank')}, outputs "
                f"{', '.join('/outputs/' + name for name in self.graph.outputs)}")  # fmt: skip
