"""Composition plans: circuits and simple ops wired into a graph (TOML), checked as a whole before anything runs.

A plan is a list of nodes and the nodes whose values are written out::

    outputs = ["head", "digits"]

    [[node]]
    name = "digits"
    circuits = "layer=relu2;usage>=10"     # a filter, or a list of circuit names

    [[node]]
    name = "head"
    op = "linear"
    inputs = ["digits"]
    weights = "head.npy"                   # out x in; FILE.npy, FILE.npz:/W or FILE.h5:/W, beside the plan
    bias = "head-bias.npy"                 # optional
    rank = 1                               # optional: where it runs (default: placed by cost)

``input`` names the data rows. A circuits node's value is one column per
circuit (in catalogue order); the ops are ``linear``, ``relu``, ``tanh``,
``sigmoid``, ``scale`` (``factor``), ``sum`` (of each row), ``add``,
``multiply`` (two or more inputs of one width), ``subtract`` (two) and
``concat``. ``load_plan`` checks the file alone (names, ops, inputs that
exist, cycles); ``graph.build_graph`` then checks it against the catalogue and
the data (missing circuits, widths), and every problem found is listed in one
message.
"""

from __future__ import annotations

import hashlib
import os
import re
import tomllib
from dataclasses import dataclass, field

import numpy as np

from .store import CatalogueError

INPUT = "input"
ELEMENTWISE = ("relu", "tanh", "sigmoid", "scale")
COMBINING = ("add", "subtract", "multiply", "concat")
OPS = ("linear", *ELEMENTWISE, "sum", *COMBINING)
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")
FLOAT32_MAX = float(np.finfo(np.float32).max)
_NODE_KEYS = {"name", "circuits", "op", "inputs", "weights", "bias", "factor", "rank"}


class PlanError(CatalogueError):
    """A plan that cannot run: every problem found, in one message."""


@dataclass(frozen=True)
class NodeSpec:
    """One node as the plan gives it."""

    name: str
    op: str  # "circuits" or one of OPS
    inputs: tuple[str, ...]
    circuits: tuple[str, ...] | str = ()  # names, or a filter (circuits nodes)
    weights: str = ""  # linear: paths resolved against the plan's directory
    bias: str = ""
    factor: float = 1.0  # scale
    rank: int | None = None


@dataclass
class PlanSpec:
    """A plan file, checked on its own."""

    path: str
    nodes: dict[str, NodeSpec]  # in topological order
    outputs: list[str]
    sha256: str
    problems: list[str] = field(default_factory=list)


def load_plan(path: str) -> PlanSpec:
    """The plan in ``path``, its nodes in an order where every node follows its inputs; PlanError lists every
    problem."""
    try:
        with open(path, "rb") as stream:
            raw = stream.read()
        document = tomllib.loads(raw.decode("utf-8-sig"))  # (with or without a byte order mark)
    except FileNotFoundError:
        raise PlanError(path, "no such plan file") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise PlanError(path, f"is not a readable TOML plan: {error}") from None
    except RecursionError:  # tomllib parses nested arrays and tables by recursion
        why = "nests arrays or tables too deep to read: a plan is [[node]] tables of flat lists"
        raise PlanError(path, why) from None
    problems: list[str] = []
    unknown = sorted(set(document) - {"node", "outputs"})
    if unknown:
        problems.append(f"unknown top-level keys {unknown} (a plan has [[node]] tables and outputs)")
    nodes: dict[str, NodeSpec] = {}
    for index, table in enumerate(document.get("node", [])):
        node = _node(table, index, os.path.dirname(os.path.abspath(path)), problems)
        if node is not None:
            if node.name in nodes:
                problems.append(f"two nodes are named {node.name!r}")
            nodes[node.name] = node
    if not nodes and not problems:
        problems.append("has no [[node]] tables")
    outputs = document.get("outputs", [])
    if not isinstance(outputs, list) or not outputs or not all(isinstance(o, str) for o in outputs):
        problems.append('outputs must be a list of the node names to write, e.g. outputs = ["head"]')
        outputs = []
    for name in outputs:
        if name not in nodes:
            problems.append(f"output {name!r} is not a node")
    for node in nodes.values():
        for source in node.inputs:
            if source != INPUT and source not in nodes:
                problems.append(f"node {node.name!r} takes {source!r}, which is not a node (nor {INPUT!r})")
    ordered = _ordered(nodes, problems)
    if problems:
        raise PlanError(path, cannot_run(problems))
    return PlanSpec(path, {name: nodes[name] for name in ordered}, list(outputs), hashlib.sha256(raw).hexdigest())


def _node(table: object, index: int, directory: str, problems: list[str]) -> NodeSpec | None:
    where = f"node {index + 1}"
    if not isinstance(table, dict):
        problems.append(f"{where} is not a table")
        return None
    name = table.get("name")
    if not isinstance(name, str) or not _NAME.match(name) or name == INPUT:
        problems.append(f"{where}: name must be a word of letters, digits, _ and - (not {INPUT!r}), got {name!r}")
        return None
    where = f"node {name!r}"
    unknown = sorted(set(table) - _NODE_KEYS)
    if unknown:
        problems.append(f"{where}: unknown keys {unknown}")
    rank = table.get("rank")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 0):
        problems.append(f"{where}: rank must be a rank number, got {rank!r}")
        rank = None
    if "circuits" in table:
        circuits = table["circuits"]
        if "op" in table or "inputs" in table:
            problems.append(f"{where}: a circuits node takes the data rows; it has no op or inputs")
        if isinstance(circuits, list) and circuits and all(isinstance(c, str) for c in circuits):
            return NodeSpec(name, "circuits", (INPUT,), tuple(circuits), rank=rank)
        if isinstance(circuits, str) and circuits.replace(";", "").strip():
            return NodeSpec(name, "circuits", (INPUT,), circuits, rank=rank)
        problems.append(f"{where}: circuits must be a filter ('layer=relu2') or a list of circuit names")
        return None
    op = table.get("op")
    if op not in OPS:
        problems.append(f"{where}: op must be one of {', '.join(OPS)} (or the node gives circuits), got {op!r}")
        return None
    inputs = table.get("inputs")
    if not isinstance(inputs, list) or not inputs or not all(isinstance(i, str) for i in inputs):
        problems.append(f"{where}: inputs must be a list of node names (or {INPUT!r})")
        return None
    wanted = 2 if op == "subtract" else (2, None) if op in COMBINING else 1
    if (wanted == 1 and len(inputs) != 1) or (op == "subtract" and len(inputs) != 2) or (
            isinstance(wanted, tuple) and len(inputs) < 2):  # fmt: skip
        how = "one input" if wanted == 1 else "two inputs" if op == "subtract" else "two or more inputs"
        problems.append(f"{where}: {op} takes {how}, got {len(inputs)}")
    weights, bias = table.get("weights", ""), table.get("bias", "")
    if op == "linear" and not weights:
        problems.append(f"{where}: linear needs weights (an out x in matrix: FILE.npy or FILE.h5:/W)")
    factor = table.get("factor", 1.0)
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not abs(factor) <= FLOAT32_MAX:
        problems.append(f"{where}: factor must be a finite number within float32's range (values are float32), "
                        f"got {factor!r}")  # fmt: skip
        factor = 1.0
    return NodeSpec(name, op, tuple(inputs), weights=_beside(weights, directory), bias=_beside(bias, directory),
                    factor=float(factor), rank=rank)  # fmt: skip


def _beside(spec: str, directory: str) -> str:
    """A matrix spec with its file relative to the plan's directory."""
    if not spec:
        return ""
    path, colon, name = spec.rpartition(":") if ":" in spec and not spec.endswith(".npy") else (spec, "", "")
    path = path if os.path.isabs(path) else os.path.join(directory, path)
    return f"{path}{colon}{name}"


PROBLEMS_SHOWN = 20  # a plan's problems listed in one message; the rest are counted


def cannot_run(problems: list[str]) -> str:
    """The message of a plan that cannot run: its first ``PROBLEMS_SHOWN`` problems, and how many more."""
    shown = "; ".join(problems[:PROBLEMS_SHOWN])
    more = len(problems) - PROBLEMS_SHOWN
    return f"cannot run: {shown}" + (f"; and {more:,} more problems" if more > 0 else "")


def _ordered(nodes: dict[str, NodeSpec], problems: list[str]) -> list[str]:
    """The nodes, each after its inputs, depth first from the plan's order (a chain stays together); a cycle is a
    problem naming its nodes. An explicit stack, not recursion: a chain of any length is ordered."""
    order: list[str] = []
    state: dict[str, str] = {}
    for root in nodes:
        if root in state:
            continue
        state[root] = "open"
        path, pending = [root], [iter(nodes[root].inputs)]  # the open nodes, and the inputs each has left to visit
        while pending:
            source = next(pending[-1], None)
            if source is None:
                state[path[-1]] = "done"
                order.append(path.pop())
                pending.pop()
            elif source in nodes and state.get(source) == "open":
                cycle = path[path.index(source) :] + [source]
                problems.append(f"nodes {' -> '.join(cycle)} form a cycle")
            elif source in nodes and source not in state:
                state[source] = "open"
                path.append(source)
                pending.append(iter(nodes[source].inputs))
    return order
