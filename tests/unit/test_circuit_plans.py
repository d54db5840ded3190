"""Composition plans in one process: what load_plan refuses, the placement by cost, and ops built and run."""

import h5py
import numpy as np
import pytest

from mpiscale.circuits.catalogue import Catalogue
from mpiscale.circuits.graph import build_graph, place
from mpiscale.circuits.plan import PlanError, load_plan
from mpiscale.circuits.sources import read_matrix
from mpiscale.circuits.store import ModelRef, NewCircuits, add_circuits


def write(tmp_path, text: str):
    path = tmp_path / "plan.toml"
    path.write_text(text)
    return str(path)


def test_load_plan_lists_every_problem_of_the_file(tmp_path):
    text = """
outputs = ["a", "nowhere"]
extra = 1
[[node]]
name = "a"
op = "subtract"
inputs = ["b"]
[[node]]
name = "b"
op = "frobnicate"
inputs = ["a"]
[[node]]
name = "c"
op = "relu"
inputs = ["d"]
colour = "red"
[[node]]
name = "c"
circuits = []
[[node]]
name = "input"
op = "relu"
inputs = ["a"]
"""
    with pytest.raises(PlanError) as refused:
        load_plan(write(tmp_path, text))
    message = str(refused.value)
    for expected in ("unknown top-level keys ['extra']", "subtract takes two inputs, got 1", "op must be one of",
                     "unknown keys ['colour']", "circuits must be a filter", "name must be a word",
                     "output 'nowhere' is not a node", "node 'c' takes 'd', which is not a node"):  # fmt: skip
        assert expected in message, message
    cycle = '[[node]]\nname = "x"\nop = "relu"\ninputs = ["y"]\n[[node]]\nname = "y"\nop = "tanh"\ninputs = ["x"]\n'
    with pytest.raises(PlanError, match="nodes x -> y -> x form a cycle"):
        load_plan(write(tmp_path, 'outputs = ["x"]\n' + cycle))
    with pytest.raises(PlanError, match="not a readable TOML plan"):
        load_plan(write(tmp_path, "outputs = ["))
    for empty in ("", " ; "):  # a filter that holds none (it would have taken every circuit)
        with pytest.raises(PlanError, match="circuits must be a filter"):
            load_plan(write(tmp_path, f'outputs = ["c"]\n[[node]]\nname = "c"\ncircuits = "{empty}"\n'))


def test_ops_run_as_the_plan_says_and_nodes_are_placed_by_cost(tmp_path):
    catalogue_path = str(tmp_path / "c.h5")
    model = ModelRef("/nowhere/m.pt", "0" * 64, "torchscript", 3, "float32")
    add_circuits(catalogue_path, NewCircuits(model, "", ["unused"], np.ones((1, 2)), "test"))
    np.save(tmp_path / "w.npy", np.arange(12.0).reshape(4, 3))
    text = """
outputs = ["out", "total"]
[[node]]
name = "big"
op = "linear"
inputs = ["input"]
weights = "w.npy"
[[node]]
name = "doubled"
op = "scale"
factor = 2
inputs = ["big"]
[[node]]
name = "both"
op = "concat"
inputs = ["big", "doubled"]
[[node]]
name = "out"
op = "relu"
inputs = ["both"]
rank = 0
[[node]]
name = "total"
op = "sum"
inputs = ["out"]
"""
    plan = load_plan(write(tmp_path, text))
    bom = tmp_path / "notepad.toml"  # the same plan as Windows' Notepad saves it: a byte order mark and CRLF
    bom.write_bytes(("\ufeff" + text.replace("\n", "\r\n")).encode())
    notepad = load_plan(str(bom))  # (it was "is not a readable TOML plan: Invalid statement")
    assert (notepad.nodes, notepad.outputs, notepad.problems) == (plan.nodes, plan.outputs, [])
    with Catalogue(catalogue_path) as catalogue:
        graph = build_graph(plan, catalogue, 3, np.dtype(np.float32), verify=False)
    rows = np.array([[1, -2, 0.5], [0, 0, -1]], np.float32)
    values = graph.run(rows)
    big = rows @ np.arange(12.0).reshape(4, 3).T
    np.testing.assert_allclose(values["out"], np.maximum(np.concatenate([big, 2 * big], axis=1), 0), rtol=1e-6)
    np.testing.assert_allclose(values["total"][:, 0], values["out"].sum(axis=1), rtol=1e-6)
    placed = place(graph, 2, "plan")
    assert placed["out"] == 0 and placed["big"] == 0 and placed["total"] == 1  # big (12 per row) outweighs the rest
    graph.nodes["out"].rank = 3
    with pytest.raises(PlanError, match="node 'out' is placed on rank 3, but the job has 2 ranks"):
        place(graph, 2, "plan")


def test_plans_of_any_depth_or_size_are_read_without_recursion_and_refused_in_a_bounded_message(tmp_path):
    """A chain of 1,000 nodes written last-first once ran into RecursionError when ordered; outputs nested 5,000
    deep made tomllib's reader recurse past its limit; 50,000 bad nodes made a message of megabytes."""
    source = ["input"] + [f"n{i}" for i in range(999)]
    chain = ['outputs = ["n999"]'] + [f'[[node]]\nname = "n{i}"\nop = "relu"\ninputs = ["{source[i]}"]'
                                      for i in reversed(range(1000))]  # fmt: skip
    plan = load_plan(write(tmp_path, "\n".join(chain)))
    assert list(plan.nodes) == [f"n{i}" for i in range(1000)]  # each node after its input
    with pytest.raises(PlanError, match="nests arrays or tables too deep to read"):
        load_plan(write(tmp_path, "outputs = " + "[" * 5000 + "]" * 5000))
    bad = ['outputs = ["n0"]'] + [f'[[node]]\nname = "n{i}"\nop = "relu"\ninputs = ["gone"]' for i in range(50_000)]
    with pytest.raises(PlanError) as refused:
        load_plan(write(tmp_path, "\n".join(bad)))
    message = str(refused.value)
    assert len(message) < 5_000 and message.endswith("; and 49,980 more problems"), message[-200:]
    cycle = 'outputs = ["a"]\n' + "".join(f'[[node]]\nname = "{n}"\nop = "relu"\ninputs = ["{m}"]\n'
                                           for n, m in (("a", "b"), ("b", "c"), ("c", "a")))  # fmt: skip
    with pytest.raises(PlanError, match="nodes a -> b -> c -> a form a cycle"):
        load_plan(write(tmp_path, cycle))


def test_a_plans_weights_are_read_from_any_file_a_user_saves_them_in(tmp_path):
    """FILE.npy, an array of a numpy.savez archive (it was "not an HDF5 file"), an HDF5 data set, or a file's only
    array; compressed archives are refused with the line that saves them uncompressed."""
    weights = np.arange(6.0).reshape(2, 3)
    np.save(tmp_path / "w.npy", weights)
    np.savez(tmp_path / "head.npz", W=weights, b=np.ones(2))
    np.savez_compressed(tmp_path / "squeezed.npz", W=weights)
    with h5py.File(tmp_path / "head.h5", "w") as file:
        file["deep/W"] = weights
    for spec in ("w.npy", "head.npz:/W", "head.h5:/deep/W", "head.h5"):
        assert np.array_equal(read_matrix(str(tmp_path / spec)), weights), spec
    assert np.array_equal(read_matrix(f"{tmp_path / 'head.npz'}:b"), [[1.0, 1.0]])
    with pytest.raises(ValueError, match=r"stores 'W' compressed \(numpy.savez_compressed\)"):
        read_matrix(f"{tmp_path / 'squeezed.npz'}:/W")
