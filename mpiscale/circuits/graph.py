"""A plan built against a catalogue and data, placed over the ranks, and run batch by batch as actors.

``build_graph`` turns each circuits node into one column per circuit and
adds one hidden node per model, ``model:N``, that runs the model once per
batch up to every layer any node of the plan reads: the prefix that many
feature circuits share is computed once, whatever the nodes that use it. Every
width is checked before anything runs (a missing circuit, weights of the
wrong shape, inputs of different widths to ``add``), and all problems are
listed in one ``PlanError``.

``place`` keeps each node a ``rank`` names and cuts the others, in the plan's
order, into consecutive runs of about equal cost (multiply-adds per row), one
per rank, as pipeline stages are cut: a chain crosses ranks once per cut.

``CompiledGraph`` is the plan compiled for one rank: the nodes it runs, in
order, and for each the ranks that need its value. For a batch, each rank runs
its nodes; a value another rank needs is sent to that rank once (however many
of its nodes use it): arrays raw on the channel of the graph (:mod:`.edges`),
received into buffers posted ahead, anything else to the rank's inbox actor;
a node takes a value from another rank when its turn comes. Several batches are in
flight at once, so the ranks work as a pipeline. An error in a node travels
along the edges in place of its value, so every rank finishes the batch and
the job ends with that node's message on every rank, never a rank left
waiting.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from ..ranks import balanced_starts
from ..runtime import Actor, ActorGroup, ActorSystem, Arrivals, Channel
from ..words import counted
from . import ops
from .catalogue import Catalogue, LayerCircuits
from .edges import Assembler, as_parts
from .filters import check_filters, matching, parse_filters
from .plan import INPUT, PlanError, PlanSpec, cannot_run
from .prefix import ModelRunner
from .sources import read_matrix
from .store import CatalogueError

_ABSENT = object()  # a value not here yet


@dataclass(frozen=True)
class Failed:
    """What a node gives instead of a value when it, or a node before it, failed."""

    message: str


@dataclass
class Node:
    """A node ready to run: its inputs, its value's width (None: a model's layers), its cost per row."""

    name: str
    inputs: tuple[str, ...]
    width: int | None
    cost: int
    compute: Callable[[list], object]
    rank: int | None = None
    model: str = ""  # a model node: the file it runs (named in its messages)

    def __str__(self) -> str:
        return f"node {self.name!r}" + (f" ({os.path.basename(self.model)})" if self.model else "")


@dataclass
class Graph:
    """A plan's nodes, each after its inputs, and the nodes written out."""

    nodes: dict[str, Node]
    outputs: list[str]
    input_width: int
    input_dtype: np.dtype
    circuits: dict[str, list[str]] = field(default_factory=dict)  # circuits node -> its circuits' names

    def run(self, rows: np.ndarray) -> dict[str, object]:
        """Every node on ``rows`` in one process, in order (the plan's meaning; the floor a compiled run is
        measured against)."""
        values: dict[str, object] = {INPUT: rows}
        for node in self.nodes.values():
            values[node.name] = node.compute([values[source] for source in node.inputs])
        return values


def build_graph(plan: PlanSpec, catalogue: Catalogue, input_width: int, input_dtype: np.dtype,
                verify: bool = True, device: str = "cpu") -> Graph:  # fmt: skip
    """The plan's nodes made runnable against ``catalogue`` and data rows of ``input_width`` numbers."""
    problems: list[str] = []
    chosen = {name: _chosen(node.circuits, catalogue, name, problems)
              for name, node in plan.nodes.items() if node.op == "circuits"}  # fmt: skip
    nodes: dict[str, Node] = {}
    circuits: dict[str, list[str]] = {}
    names = catalogue.column("name")
    parts = {name: catalogue.layers_of(rows) for name, rows in chosen.items() if len(rows)}
    prefixes = _prefix_nodes(catalogue, parts, input_width, verify, problems, device)
    widths: dict[str, int | None] = {INPUT: input_width}
    for prefix in prefixes.values():
        nodes[prefix.name] = prefix
        widths[prefix.name] = None
    for name, spec in plan.nodes.items():
        node: Node | None = None
        if spec.op == "circuits":
            if len(chosen[name]):  # none: a problem already, and no width to check others against
                node = _circuits_node(name, parts[name], len(chosen[name]), spec.rank)
                circuits[name] = [str(names[row]) for row in chosen[name]]
        else:
            node = _op_node(spec, [widths.get(source) for source in spec.inputs], problems)
        if node is not None:
            nodes[name] = node
            widths[name] = node.width
    if problems:
        raise PlanError(plan.path, cannot_run(problems))
    return Graph(nodes, plan.outputs, input_width, input_dtype, circuits)


def _chosen(selected: tuple[str, ...] | str, catalogue: Catalogue, node: str, problems: list[str]) -> np.ndarray:
    """The catalogue rows of a circuits node (names, or a filter), in catalogue order."""
    if isinstance(selected, str):
        try:
            filters = parse_filters([selected])
            check_filters(catalogue, filters)
        except (ValueError, CatalogueError) as error:
            problems.append(f"node {node!r}: {error}")
            return np.empty(0, np.int64)
        rows = np.flatnonzero(matching(catalogue, filters))
        if not len(rows):
            problems.append(f"node {node!r}: no circuit matches {selected!r}")
        return rows
    index = catalogue.rows_named(selected)
    missing = [name for name in selected if name not in index]
    if missing:
        problems.append(f"node {node!r}: the catalogue has no circuit {', '.join(map(repr, missing))}")
    return np.array(sorted(index[name] for name in selected if name in index), np.int64)


def _prefix_nodes(catalogue: Catalogue, parts: dict[str, list[LayerCircuits]], input_width: int, verify: bool,
                  problems: list[str], device: str) -> dict[int, Node]:  # fmt: skip
    """One node per model any circuits node reads, running it (on ``device``) up to every layer the plan needs."""
    layers: dict[int, set[str]] = {}
    for node_parts in parts.values():
        for part in node_parts:
            layers.setdefault(part.model, set()).add(part.layer)
    nodes = {}
    for model, wanted in sorted(layers.items()):
        reference = catalogue.models[model]
        if reference.inputs != input_width:
            problems.append(f"model {reference.path} takes rows of {reference.inputs} numbers; the data's rows have "
                            f"{input_width}")  # fmt: skip
            continue
        runner = ModelRunner(reference, sorted(wanted), verify, device)
        cost = max(1, _parameters(runner))
        nodes[model] = Node(f"model:{model}", (INPUT,), None, cost, partial(_run_model, runner), model=reference.path)
    return nodes


def _parameters(runner: ModelRunner) -> int:
    return sum(int(p.numel()) for p in runner.module.parameters())


def _run_model(runner: ModelRunner, inputs: list) -> dict[str, np.ndarray]:
    return runner(inputs[0])


def _circuits_node(name: str, parts: list[LayerCircuits], width: int, rank: int | None) -> Node:
    """The node whose value is one column per circuit of ``parts``: each layer's atoms as one product."""
    sources = tuple(dict.fromkeys(f"model:{part.model}" for part in parts))
    cost = max(1, sum(part.atoms.size for part in parts))
    return Node(name, sources, width, cost, partial(_project, parts, width), rank)


def _project(parts: list[LayerCircuits], width: int, inputs: list) -> np.ndarray:
    by_model = dict(zip(dict.fromkeys(part.model for part in parts), inputs))  # the inputs follow the sources
    first = parts[0]
    out = np.empty((len(by_model[first.model][first.layer]), width), np.float32)
    for part in parts:
        part.project(by_model[part.model][part.layer], out)
    return out


def _op_node(spec, widths: list[int | None], problems: list[str]) -> Node | None:
    """An op node, its widths checked against its inputs'."""
    where = f"node {spec.name!r}"
    if any(width is None for width in widths):
        return None  # an input that failed its own checks: already a problem
    width = widths[0] or 0
    if spec.op == "linear":
        try:
            weights = _finite_float32(read_matrix(spec.weights), "weights")
            bias = _finite_float32(read_matrix(spec.bias), "bias").reshape(-1) if spec.bias else None
        except (ValueError, CatalogueError) as error:
            problems.append(f"{where}: {error}")
            return None
        if weights.shape[1] != width:
            problems.append(f"{where}: weights are {weights.shape[0]} x {weights.shape[1]}, but its input "
                            f"{spec.inputs[0]!r} is {width} wide (weights are out x in)")  # fmt: skip
        if bias is not None and len(bias) != weights.shape[0]:
            problems.append(f"{where}: bias has {len(bias)} numbers for {weights.shape[0]} outputs")
        return Node(spec.name, spec.inputs, weights.shape[0], weights.size, partial(ops.linear, weights, bias),
                    spec.rank)  # fmt: skip
    if spec.op in ops.ELEMENTWISE:
        return Node(spec.name, spec.inputs, width, width, partial(ops.elementwise, spec.op, spec.factor), spec.rank)
    if spec.op == "sum":
        return Node(spec.name, spec.inputs, 1, width, ops.row_sum, spec.rank)
    if spec.op == "concat":
        total = sum(w or 0 for w in widths)
        return Node(spec.name, spec.inputs, total, total, ops.combining("concat"), spec.rank)
    if len(set(widths)) > 1:
        shown = ", ".join(f"{source} ({w})" for source, w in zip(spec.inputs, widths))
        problems.append(f"{where}: {spec.op} takes inputs of one width, got {shown}")
    return Node(spec.name, spec.inputs, width, width, ops.combining(spec.op), spec.rank)


def _finite_float32(matrix: np.ndarray, what: str) -> np.ndarray:
    """``matrix`` as float32 (how a plan computes), refused where it holds NaN or infinity, or a value beyond
    float32's range."""
    values = matrix.astype(np.float32)
    bad = np.argwhere(~np.isfinite(values))
    if len(bad):
        where = tuple(int(i) for i in bad[0])
        raise ValueError(f"{what} hold {float(matrix[where]):g} at {where} ({len(bad)} values are NaN, infinite "
                         "or beyond float32's range): a plan computes in float32")  # fmt: skip
    return values


def place(graph: Graph, size: int, where: str) -> dict[str, int]:
    """Each node's rank: the one its plan names, or its part of the cost-balanced cut of the others."""
    problems = [f"node {n.name!r} is placed on rank {n.rank}, but the job has {counted(size, 'rank')}"
                for n in graph.nodes.values() if n.rank is not None and n.rank >= size]  # fmt: skip
    if problems:
        raise PlanError(where, cannot_run(problems))
    placed = {n.name: n.rank for n in graph.nodes.values() if n.rank is not None}
    free = [n for n in graph.nodes.values() if n.rank is None]
    if free:
        parts = min(size, len(free))
        starts = balanced_starts([n.cost for n in free], parts) + [len(free)]
        for part in range(parts):
            for node in free[starts[part] : starts[part + 1]]:
                placed[node.name] = part
    return placed


class GraphInbox(Actor):
    """The message end of a rank's part of a compiled graph: values other ranks' nodes tell it."""

    def __init__(self, arrivals: Arrivals[tuple[int, str], object]) -> None:
        self.arrivals = arrivals

    def value(self, batch: int, node: str, value: object) -> None:
        self.arrivals.put((batch, node), value)


class CompiledGraph:
    """This rank's part of a graph placed over the job's ranks (``start`` is collective)."""

    def __init__(self, system: ActorSystem, graph: Graph, placement: dict[str, int]) -> None:
        self.system, self.graph, self.placement = system, graph, placement
        rank = system.rank
        self.mine = [node for node in graph.nodes.values() if placement[node.name] == rank]
        self.reads_input = any(INPUT in node.inputs for node in self.mine)
        consumers: dict[str, set[int]] = {}
        for node in graph.nodes.values():
            for source in node.inputs:
                if source != INPUT and placement[source] != placement[node.name]:
                    consumers.setdefault(source, set()).add(placement[node.name])
        self.sends = {node.name: sorted(consumers.get(node.name, ())) for node in self.mine}
        self.outputs = [name for name in graph.outputs if placement[name] == rank]
        self.arrivals: Arrivals[tuple[int, str], object] = Arrivals("graph value")
        self.inboxes: ActorGroup | None = None
        self._lanes = {name: lane for lane, name in enumerate(graph.nodes)}  # a node's values travel on its lane
        self._names = list(graph.nodes)
        self._channel: Channel | None = None

    async def start(self, name: str = "circuit-graph") -> None:
        """Collective: the inboxes and the channel that carry this graph's values between ranks."""
        self.inboxes = await self.system.spawn_group(GraphInbox, self.arrivals, name=name)
        assembler = Assembler(lambda source, lane, batch, value: self.arrivals.put((batch, self._names[lane]), value))
        self._channel = await self.system.channel(f"{name}.values", assembler.part)

    async def run_batch(self, batch: int, rows: np.ndarray | Failed | None) -> tuple[dict[str, np.ndarray], str | None]:
        """This rank's nodes on batch ``batch`` (``rows``: the data, where a node here reads it, or why it could not
        be read): the values of the outputs this rank holds, and the first failure seen here (None: none)."""
        assert self.inboxes is not None and self._channel is not None, "start the graph first"
        values: dict[str, object] = {INPUT: rows}
        arrivals, sends = self.arrivals, self.sends
        for node in self.mine:
            inputs = []
            failed = None
            for source in node.inputs:
                value = values.get(source, _ABSENT)
                if value is _ABSENT:
                    value = values[source] = await arrivals.take((batch, source), partial(self._expect, batch, source))
                if failed is None and type(value) is Failed:
                    failed = value
                inputs.append(value)
            if failed is None:
                try:
                    value = node.compute(inputs)
                except Exception as error:  # the node's own failure, passed on in place of its value
                    value = Failed(f"{node} on batch {batch}: {type(error).__name__}: {error}")
            else:
                value = failed
            values[node.name] = value
            if sends[node.name] and not self._send(batch, node.name, value):
                await asyncio.sleep(0)  # an actor message leaves at the turn's end: end it, so the next rank starts
        failure = next((v.message for n in self.mine if isinstance(v := values[n.name], Failed)), None)
        held = {name: values[name] for name in self.outputs if not isinstance(values[name], Failed)}
        return held, failure  # type: ignore[return-value]

    def _send(self, batch: int, node: str, value: object) -> bool:
        """``value`` to every rank that needs it: arrays raw on the node's lane (True), anything else as an actor
        message (False: it leaves at the loop turn's end)."""
        assert self.inboxes is not None and self._channel is not None
        parts = as_parts(value)
        for rank in self.sends[node]:
            if parts is None:
                self.inboxes[rank].tell("value", batch, node, value)
            else:
                for index, part in enumerate(parts):
                    self._channel.send(rank, self._lanes[node], (batch, index, len(parts)), part)
        return parts is not None

    def _expect(self, batch: int, source: str, future: asyncio.Future) -> None:
        self.system.expect(future, f"graph value {source!r} of batch {batch} from rank {self.placement[source]}")
