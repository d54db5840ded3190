"""A memory-store run's files read back for comparison: each iteration's results, the records, the recovery report;
and the bit-for-bit comparison of a recovered run with an uninterrupted one (nothing lost, nothing applied twice)."""

import json

import h5py
import numpy as np


def results(out) -> tuple[dict, dict, dict]:
    """(per-iteration results, the records sorted by id, the recovery report) of a run."""
    with h5py.File(out, "r") as file:
        history = {name: file[name][()] for name in file if name != "iteration_s"}
        report = json.loads(file.attrs.get("recovery", "{}"))
    with h5py.File(str(out).replace(".h5", ".records.h5"), "r") as file:
        records = {name: file[name][()] for name in file}
    order = np.argsort(records["ids"])
    return history, {name: values[order] for name, values in records.items()}, report


def assert_same(run, reference, records: int, iterations: int) -> None:
    """Every record and every iteration's results of ``run`` equal to ``reference``'s, bit for bit."""
    for got, expected in zip(run[:2], reference[:2]):
        assert got.keys() == expected.keys()
        for name in expected:
            assert np.array_equal(got[name], expected[name]), name
    assert len(run[1]["ids"]) == records and len(run[0]["count"]) == iterations
