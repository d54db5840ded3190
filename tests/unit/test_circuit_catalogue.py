"""The catalogue's parts in one process: the running top-k, the batch checks, appends, the lock, and filters."""

import os

import h5py
import numpy as np
import pytest

from mpiscale.circuits.catalogue import Catalogue
from mpiscale.circuits.filters import Filter, check_filters, matching, parse_filters
from mpiscale.circuits.layout import space_group
from mpiscale.circuits.store import CatalogueError, ModelRef, NewCircuits, add_circuits
from mpiscale.io import LockedError, OutputLock
from mpiscale.kernels.topk import NO_ID, empty_top_k, merge_top_k

MODEL = ModelRef("/nowhere/model.pt", "0" * 64, "torchscript", 4, "float32")


def batch(names, width=3, **more) -> NewCircuits:
    rng = np.random.default_rng(len(names))
    return NewCircuits(MODEL, "", list(names), rng.standard_normal((len(names), width)), "test", **more)


def test_the_running_top_k_is_the_same_whatever_the_blocks_and_breaks_ties_by_id():
    """Many identical rows (ties) among random ones: each row's score is the same bits wherever it sits, so every
    blocking, a filtered copy too, gives the order a float64 sort gives, ties to the smaller id."""
    rng = np.random.default_rng(0)
    distinct = rng.standard_normal((5, 32))
    vectors = distinct[rng.integers(0, 5, 500)] + np.where(rng.random((500, 1)) < 0.3, rng.standard_normal((500, 32)),
                                                           0.0)  # fmt: skip
    vectors = (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)
    queries = distinct[:3] / np.linalg.norm(distinct[:3], axis=1, keepdims=True)
    queries = queries.astype(np.float32)
    ids = rng.permutation(500).astype(np.int64)
    allowed = rng.random(500) < 0.7
    exact = queries.astype(np.float64) @ vectors.astype(np.float64).T  # float32 inputs: products exact in float64
    expected = []
    for row in exact.astype(np.float32):
        candidates = [(-row[j], ids[j]) for j in range(500) if allowed[j]]
        expected.append([identity for _, identity in sorted(candidates)[:40]])
    assert len({tuple(v) for v in vectors[allowed]}) < allowed.sum()  # there are ties to break
    for block in (500, 64, 7, 1):
        best, best_ids = empty_top_k(3, 40)
        for lo in range(0, 500, block):
            part = slice(lo, lo + block)
            keep = allowed[part]
            rows = vectors[part][keep] if block == 64 else vectors[part]  # a filtered copy moves rows around
            merge_top_k(queries @ rows.T, queries, rows, ids[part][keep] if block == 64 else ids[part],
                        np.ones(len(rows), bool) if block == 64 else keep, best, best_ids)  # fmt: skip
        assert best_ids.tolist() == expected
    best, best_ids = empty_top_k(1, 4)
    two = np.eye(2, 4, dtype=np.float32)
    merge_top_k(two[:1] @ two.T, two[:1], two, np.array([9, 3]), np.array([True, False]), best, best_ids)
    assert best_ids.tolist() == [[9, NO_ID, NO_ID, NO_ID]] and np.isinf(best[0, 1:]).all()


def test_batches_append_and_fields_widen_and_refusals_leave_the_file_as_it_was(tmp_path):
    path = str(tmp_path / "c.h5")
    assert add_circuits(path, batch(["a", "b"], tags=["x"], fields={"n": [1, 2]})) == 2
    assert add_circuits(path, batch(["c"], fields={"who": ["me"]}, space="s2")) == 3
    with Catalogue(path) as catalogue:
        assert list(catalogue.column("name")) == ["a", "b", "c"]
        assert np.isnan(catalogue.column("n")[2]) and list(catalogue.column("who")) == ["", "", "me"]
        assert [s.name for s in catalogue.spaces] == ["model:output", "s2"] and len(catalogue.prefixes) == 1
        assert catalogue.atoms(0).shape == (3, 3)
        assert catalogue.find(["c", "a"]) == [2, 0]
        with pytest.raises(TypeError, match=r"names is a list of circuit names, got the str 'ab': give \['ab'\]"):
            catalogue.find("ab")  # (its letters were looked up: circuits a and b, found)
    before = open(path, "rb").read()
    refusals = [
        (batch(["a"]), "holds a circuit named 'a' already"),
        (batch(["d", "d"]), "names two circuits 'd'"),
        (batch(["d"], width=5), "atoms are 5 wide"),
        (batch(["d"], fields={"n": ["text"]}), "field 'n' is number"),
        (batch(["d"], tags=["a,b"]), "without commas"),
        (batch(["d"], fields={"1x": [1]}), "field '1x'"),
        (NewCircuits(MODEL, "", ["d"], np.zeros((1, 3)), "test"), "atoms row 0 is all zeros"),
        (NewCircuits(MODEL, "", ["d"], np.full((1, 3), np.nan), "test"), "atoms row 0 holds NaN"),
    ]
    for bad, message in refusals:
        with pytest.raises(CatalogueError, match=message):
            add_circuits(path, bad)
    assert open(path, "rb").read() == before and not os.path.exists(f"{path}.tmp")


def test_directions_are_kept_at_any_scale_float64_holds(tmp_path):
    """Embeddings and queries of 1e160 and 1e-170 have the directions of the same values at 1: their norms' squares
    once overflowed (unit vectors of zeros: every cosine 0) or underflowed (a norm of 0: vectors of NaN, or a query
    refused as all zeros). Atoms float32 cannot hold (they are kept as float32) are refused: they were stored as
    infinities or zeros."""
    from mpiscale.circuits.similar import unit_queries

    rows = np.random.default_rng(3).standard_normal((3, 4))
    path = str(tmp_path / "c.h5")
    for scale, name in ((1.0, "unit"), (1e160, "huge"), (1e-170, "tiny")):
        add_circuits(path, NewCircuits(MODEL, "", [f"{name}{i}" for i in range(3)], rows, "test", space=name,
                                       embeddings=rows * scale))  # fmt: skip
    with Catalogue(path) as catalogue, h5py.File(path, "r") as file:
        unit, _ = catalogue.vectors(0, 0, 3)
        for space, scale in ((1, 1e160), (2, 1e-170)):
            np.testing.assert_array_equal(catalogue.vectors(space, 0, 3)[0], unit)
            norms = file[space_group(space)]["norm"][()]
            np.testing.assert_allclose(norms / scale, np.linalg.norm(rows, axis=1), rtol=1e-14)
    for scale in (1e160, 1e-170):
        np.testing.assert_array_equal(unit_queries(rows * scale, "test"), unit_queries(rows, "test"))
    before = open(path, "rb").read()
    for scale, message in ((1e39, "past float32's largest"), (1e-50, "is zeros in float32")):
        with pytest.raises(CatalogueError, match=message):
            add_circuits(path, NewCircuits(MODEL, "", ["x"], rows[:1] * scale, "test"))
    assert open(path, "rb").read() == before


def test_a_second_writer_is_refused_while_one_adds(tmp_path):
    path = str(tmp_path / "c.h5")
    add_circuits(path, batch(["a"]))
    holder = OutputLock(f"{path}.lock", "another job")
    holder.acquire()
    try:
        with pytest.raises(LockedError, match="is in use by another job"):
            add_circuits(path, batch(["b"]))
    finally:
        holder.release()
    assert add_circuits(path, batch(["b"])) == 2


def test_filters_parse_check_and_match(tmp_path):
    path = str(tmp_path / "c.h5")
    add_circuits(path, batch(["p/1", "p/2", "q/1"], tags=["t"], fields={"score": [1.0, 5.0, 9.0]}))
    with Catalogue(path) as catalogue:
        assert matching(catalogue, parse_filters(["score>=5;name=p/*"])).tolist() == [False, True, False]
        assert matching(catalogue, parse_filters(["tag!=t"])).tolist() == [False, False, False]
        assert matching(catalogue, parse_filters(["score>=5;"])).tolist() == [False, True, True]  # a trailing ";"
        for empty in ("", " ", ";"):  # ``--where "$LAYERS"`` with the variable unset took every circuit
            with pytest.raises(ValueError, match="holds no filter .an unset shell variable.*leave --where out"):
                parse_filters(["score>=5", empty])
        chosen = matching(catalogue, parse_filters(["model=model.pt", "atom=-1", "name=q/*"]))
        assert chosen.tolist() == [False, False, True]
        for text, message in (("nope=1", "no column 'nope'"), ("name>2", "name is text"),
                              ("score=high", "'high' is not one"), ("score=nan", "NaN matches nothing")):  # fmt: skip
            with pytest.raises(CatalogueError, match=message):
                check_filters(catalogue, [Filter.parse(text)])
    with pytest.raises(ValueError, match="write KEY=VALUE"):
        Filter.parse("just words")
    with h5py.File(path, "r") as file:  # plain h5py reads what the filters read
        assert list(file["circuits/fields/score"][()]) == [1.0, 5.0, 9.0]
