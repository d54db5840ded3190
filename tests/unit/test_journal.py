"""The store's journal, in one process: records encoded and decoded, and which copy of each old rank's log is read."""

import numpy as np
import pytest

from mpiscale.io import CheckpointError
from mpiscale.memstore.journal import Op, Segment, decode_commit, encode_commit, existing_segments, lost_logs


def test_a_commit_survives_encoding_with_its_notes():
    ops = [
        Op("upsert", np.array([5, 9], np.int64), np.arange(8, dtype=np.float32).reshape(2, 4)),
        Op("delete", np.array([3], np.int64)),
        Op("reinforce", np.array([9], np.int64), np.array([0.25], np.float32), 7.0),
        Op("decay", scalar=0.01),
    ]
    commit = decode_commit(12, encode_commit(ops, {"mean": np.array([0.5])}))
    assert commit.number == 12 and [op.kind for op in commit.ops] == ["upsert", "delete", "reinforce", "decay"]
    for got, sent in zip(commit.ops, ops):
        assert got.scalar == sent.scalar
        for name in ("ids", "values"):
            expected = getattr(sent, name)
            assert (getattr(got, name) is None) if expected is None else np.array_equal(getattr(got, name), expected)
    assert commit.notes["mean"].tolist() == [0.5]


def segment(node, copy, rank, start, world=4):
    kind = "copy-of-rank" if copy else "rank"
    return Segment(node, copy, rank, world, start, f"run-1.{kind}-{rank:05d}-of-{world:05d}.from-{start:08d}.wal")


def test_own_node_first_then_the_partner_copy_and_lost_ranks_named():
    found = [segment(0, False, 0, 10), segment(0, False, 0, 20), segment(1, True, 0, 10), segment(1, True, 0, 20)]
    found += [segment(0, True, 2, 10), segment(0, True, 2, 20)]  # rank 2's own node is gone
    found += [segment(1, False, 3, 10), segment(0, True, 3, 10), segment(0, True, 3, 20)]  # own node has fewer
    chosen = existing_segments("1", found)
    assert [(s.node, s.copy) for s in chosen[0]] == [(0, False), (0, False)]
    assert [(s.node, s.copy) for s in chosen[2]] == [(0, True), (0, True)]
    assert [s.start for s in chosen[3]] == [10, 20] and all(s.copy for s in chosen[3])
    assert lost_logs(found, 4) == [1] and lost_logs(found, None) == [1]  # the run's record says 4, or the logs do
    assert lost_logs([], 4) == [0, 1, 2, 3] and lost_logs([], None) == []  # every log gone; an old record: unknown


def test_logs_of_two_world_sizes_in_one_run_are_refused():
    with pytest.raises(CheckpointError, match="several world sizes"):
        existing_segments("1", [segment(0, False, 0, 10), segment(0, False, 1, 10, world=2)])
