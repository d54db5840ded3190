"""The partitioned memory store under real mpirun: the same bits on 1-4 ranks as a numpy model, and bad input."""

import re
import subprocess
import sys

import h5py
import numpy as np
import pytest
from helpers import Worlds, assert_ok, finish, launch

MPISCALE = [sys.executable, "-m", "mpiscale.cli"]


def mpiscale(ranks: int, *args, timeout: float = 180):
    return finish(launch(ranks, [*MPISCALE, *map(str, args)]), f"mpiscale {' '.join(map(str, args))}", timeout)


#: The library-level checks of each world size, in one MPI world (``helpers.Worlds``).
world = Worlds({
    1: (1, {}, ["memstore_invariance.py 4000 14", "memstore_errors.py"]),
    2: (2, {}, ["memstore_invariance.py 4000 14", "memstore_queries.py"]),
    3: (3, {}, ["memstore_invariance.py 4000 14", "memstore_errors.py"]),
    4: (4, {}, ["memstore_invariance.py 4000 14", "memstore_queries.py"]),
})  # fmt: skip


def test_same_state_aggregates_and_ranking_on_any_number_of_ranks():
    """Upserts (repeated ids), deletes, reinforcements (repeated ids) and decay: every world size, one digest."""
    digests = {}
    for ranks in (1, 2, 3, 4):
        job = world(ranks)
        found = re.search(r"memstore ok: (\d+) ranks, (\d+) records, digest (\w+)", job.stdout)
        assert found and int(found.group(1)) == ranks, job.stdout
        digests[ranks] = found.group(3)
    assert len(set(digests.values())) == 1, digests


@pytest.mark.parametrize("ranks", [1, 3])
def test_bad_input_is_refused_on_every_rank_and_changes_nothing(ranks):
    assert f"memstore errors ok: {ranks} ranks" in world(ranks).stdout


@pytest.mark.parametrize("ranks", [2, 4])
def test_queries_while_iterating_match_the_store(ranks):
    assert f"memstore queries ok: {ranks} ranks" in world(ranks).stdout


def _read(path) -> dict:
    with h5py.File(path, "r") as file:
        return {name: file[name][()] for name in file}


def test_memstore_job_gives_the_same_results_on_one_and_three_ranks(tmp_path):
    """mpiscale memstore: the aggregates, top-k and final records of 1 and 3 ranks, bit for bit; inspect reads them."""
    runs = {}
    for ranks in (1, 3):
        out = tmp_path / f"ms{ranks}.h5"
        job = mpiscale(ranks, "memstore", "--records", 30000, "--iterations", 8, "--top", 20, "--out", out)
        assert_ok(job)
        records = _read(tmp_path / f"ms{ranks}.records.h5")
        order = np.argsort(records["ids"])
        runs[ranks] = _read(out), {name: values[order] for name, values in records.items()}
    (results_1, records_1), (results_3, records_3) = runs[1], runs[3]
    assert results_1.keys() == results_3.keys() and records_1.keys() == records_3.keys()
    for name in results_1:
        if name != "iteration_s":
            assert np.array_equal(results_1[name], results_3[name]), name
    for name in records_1:
        assert np.array_equal(records_1[name], records_3[name]), name
    assert len(records_1["ids"]) == 30000 and (results_1["count"] == 30000).all()
    assert records_1["touched"].max() == 7  # reinforced in the last iteration
    shown = subprocess.run([*MPISCALE, "inspect", str(tmp_path / "ms3.h5")], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "30,000 records, 8 iterations on 3 ranks" in shown.stdout


def test_memstore_job_refuses_bad_settings(tmp_path):
    job = mpiscale(2, "memstore", "--reinforce", 2.0, "--out", tmp_path / "x.h5")
    assert job.returncode == 2 and "reinforce must be a fraction in [0, 1]" in job.stderr
