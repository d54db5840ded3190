"""One rank's partition of the memory store, in one process: what a record keeps, exactly."""

import numpy as np

from mpiscale.memstore.partition import Partition


def test_the_iteration_that_last_touched_a_record_reads_back_exactly_past_float32s_integers():
    """``touched`` was float32, whose integers end at 2**24: iteration 2**25 + 1 read back as 2**25."""
    partition = Partition(extra=("weight",))
    ids = np.array([5, 9, 11], np.int64)
    values = {"strength": np.full(3, 0.5, np.float32), "quality": np.ones(3, np.float32),
              "weight": np.zeros(3, np.float32), "touched": np.zeros(3, np.int64)}  # fmt: skip
    partition.upsert(ids, values)
    late = 2**25 + 1
    partition.reinforce(partition.rows_of(np.array([9])), np.array([0.1], np.float32), late)
    assert partition.column("touched").dtype == np.int64
    assert partition.column("touched").tolist() == [0, late, 0]
    found, table = partition.read(np.array([9, 7]))
    assert found.tolist() == [True, False] and table[0, partition.names.index("touched")] == late
    assert table[0, 0] == np.float32(0.6) and np.isnan(table[1]).all()
