"""The data fingerprint a resumed run compares: alike for any split of the rows, changed by any one value."""

import numpy as np
from mpi4py import MPI

from mpiscale.io import Fingerprint


def digest(*blocks: tuple[int, np.ndarray]) -> str:
    fingerprint = Fingerprint()
    for first, rows in blocks:
        fingerprint.add(first, rows)
    return fingerprint.digest(MPI.COMM_SELF)


def test_any_split_of_the_rows_in_any_order_gives_the_same_digest():
    rows = np.random.default_rng(0).standard_normal((1000, 7)).astype(np.float32)
    whole = digest((0, rows))
    assert digest((600, rows[600:]), (0, rows[:1]), (1, rows[1:600])) == whole
    assert digest((0, rows[:0]), (0, rows)) == whole  # a rank without rows adds nothing


def test_one_value_changed_in_its_last_bit_or_moved_changes_the_digest():
    rows = np.random.default_rng(1).standard_normal((500, 5))
    whole = digest((0, rows))
    for row, column in [(0, 0), (250, 3), (499, 4)]:
        changed = rows.copy()
        changed[row, column] = np.nextafter(changed[row, column], np.inf)
        assert digest((0, changed)) != whole, (row, column)
    assert digest((0, rows[::-1])) != whole  # rows in another order
    assert digest((0, rows[:, ::-1])) != whole  # columns in another order
    assert digest((1, rows)) != whole  # the same rows one further on


def test_the_values_count_not_their_storage():
    """Integers stored as uint8 or as float64 are the same values; the shape passed to digest is compared too."""
    tokens = np.arange(600, dtype=np.uint8).reshape(200, 3)
    assert digest((0, tokens)) == digest((0, tokens.astype(np.float64)))
    fingerprint = Fingerprint()
    fingerprint.add(0, tokens)
    assert fingerprint.digest(MPI.COMM_SELF, (200, 3)) != fingerprint.digest(MPI.COMM_SELF, (100, 6))


def test_a_block_weighed_alone_is_what_adding_it_adds():
    """``weigh`` is a block's own digest (what circuits run keeps per batch): the blocks' weights add up to the
    whole's sum, and it adds nothing to the fingerprint."""
    rows = np.random.default_rng(2).standard_normal((300, 4))
    fingerprint = Fingerprint()
    parts = [fingerprint.weigh(first, rows[first : first + 100]) for first in (0, 100, 200)]
    fingerprint.add(0, rows)
    assert sum(parts) % 2**64 == fingerprint.weigh(0, rows)
    assert fingerprint.digest(MPI.COMM_SELF) == digest((0, rows))
    assert fingerprint.weigh(100, rows[100:200]) == parts[1] != fingerprint.weigh(101, rows[100:200])
