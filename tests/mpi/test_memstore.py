"""The partitioned memory store under real mpirun: the same bits on 1-4 ranks as a numpy model, and bad input."""

import re

import pytest
from conftest import assert_ok, run_mpi


def test_same_state_aggregates_and_ranking_on_any_number_of_ranks():
    """Upserts (repeated ids), deletes, reinforcements (repeated ids) and decay: every world size, one digest."""
    digests = {}
    for ranks in (1, 2, 3, 4):
        job = run_mpi("memstore_invariance.py", ranks, "4000", "14", timeout=180)
        assert_ok(job)
        found = re.search(r"memstore ok: (\d+) ranks, (\d+) records, digest (\w+)", job.stdout)
        assert found and int(found.group(1)) == ranks, job.stdout
        digests[ranks] = found.group(3)
    assert len(set(digests.values())) == 1, digests


@pytest.mark.parametrize("ranks", [1, 3])
def test_bad_input_is_refused_on_every_rank_and_changes_nothing(ranks):
    job = run_mpi("memstore_errors.py", ranks, timeout=120)
    assert_ok(job)
    assert f"memstore errors ok: {ranks} ranks" in job.stdout
