"""Which allreduces two ranks do by exchange: the choice every rank of a call must make alike, from its arguments."""

import numpy as np
import pytest

from mpiscale.runtime.pair_reduce import HALVES_FROM_BYTES, UFUNCS, exchanged, room


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int8, np.int64, np.uint32, np.complex128])
def test_sums_of_numbers_between_two_ranks_are_exchanged(dtype):
    assert exchanged(2, np.dtype(dtype), np.add) is np.add


@pytest.mark.parametrize("size", [1, 3, 4, 64])
def test_other_rank_counts_keep_mpis_own_call(size):
    assert exchanged(size, np.dtype(np.float64), np.add) is None


@pytest.mark.parametrize(
    ("dtype", "op"),
    [
        (np.float16, "sum"),  # MPI has no half-precision sum: its own call says so, as before
        (np.bool_, "sum"),  # numpy's add of booleans is an or, MPI refuses the sum
        (np.complex128, "min"),  # no order on complex numbers in MPI
        (np.complex64, "max"),
        ("V8", "sum"),
    ],
)
def test_what_mpi_reduces_otherwise_or_refuses_is_left_to_it(dtype, op):
    assert exchanged(2, np.dtype(dtype), UFUNCS[op]) is None


def test_an_operation_without_a_twin_is_left_to_mpi():
    assert exchanged(2, np.dtype(np.float64), None) is None
    assert exchanged(2, np.dtype(np.float64), np.subtract) is None


def test_the_room_for_the_other_ranks_values_is_all_of_them_or_the_larger_half():
    small = np.zeros(HALVES_FROM_BYTES // 8 - 1)
    assert room(small) == small.nbytes
    odd = np.zeros(HALVES_FROM_BYTES // 8 + 1)  # halves of (n // 2) and (n - n // 2) elements
    assert room(odd) == (odd.size - odd.size // 2) * 8 < odd.nbytes
