"""Numba kernels of the partitioned memory store: the partition hash, the id index, one fused pass per iteration.

- ``owners``: splitmix64's finaliser of each id, modulo the ranks: sequential ids
  spread evenly, unlike ``id % ranks``.
- The id index is open addressing with linear probing: a power-of-two table of
  row numbers (int32, -1 empty) at most half full, keys read from the id column.
  That is 8 bytes per record beside the columns.
- ``iteration_pass`` is one pass over the columns per iteration: decay each
  strength (subtract, clamp to [0, 1]) and, from the qualities, the count, the
  maximum, a fixed-bin histogram, the exact sum and each thread's top-k by
  (quality descending, id ascending). The sum is exact and independent of the
  order of addition: every float32 is an integer mantissa times a power of two,
  and the mantissas are added as integers per exponent (``EXPONENT_BINS``);
  ``exact_total`` turns the bins into the correctly rounded sum. So the
  aggregates are the same bits on any number of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import get_num_threads, njit, prange

EXPONENT_BINS = 256
_EMPTY = -1


@njit(inline="always", cache=True)
def _mix(value):
    z = np.uint64(value) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


#: Below this many ids a kernel runs on the calling thread: waking Numba's threads for a few ids took
#: milliseconds when the other cores were busy (a single-record query went from 0.3 to 12 ms).
PARALLEL_FROM = 4096


@njit(cache=True)
def _owners_serial(ids, ranks, out):
    for i in range(ids.size):
        out[i] = np.int64(_mix(ids[i]) % np.uint64(ranks))


@njit(parallel=True, cache=True)
def _owners_parallel(ids, ranks, out):
    for i in prange(ids.size):
        out[i] = np.int64(_mix(ids[i]) % np.uint64(ranks))


def owners(ids: np.ndarray, ranks: int) -> np.ndarray:
    """The rank that owns each id."""
    out = np.empty(ids.size, np.int64)
    (_owners_parallel if ids.size >= PARALLEL_FROM else _owners_serial)(ids, ranks, out)
    return out


@njit(cache=True)
def build_index(ids, capacity):
    """An index of ``ids`` (unique) in a table of ``capacity`` slots (a power of two)."""
    slots = np.full(capacity, _EMPTY, np.int32)
    mask = np.uint64(capacity - 1)
    for row in range(ids.size):
        slot = _mix(ids[row]) & mask
        while slots[slot] != _EMPTY:
            slot = (slot + np.uint64(1)) & mask
        slots[slot] = row
    return slots


@njit(inline="always", cache=True)
def _find(slots, ids, key, mask):
    slot = _mix(key) & mask
    while True:
        row = slots[slot]
        if row == _EMPTY:
            return -1
        if ids[row] == key:
            return row
        slot = (slot + np.uint64(1)) & mask


@njit(cache=True)
def _find_serial(slots, ids, queries, out):
    mask = np.uint64(slots.size - 1)
    for i in range(queries.size):
        out[i] = _find(slots, ids, queries[i], mask)


@njit(parallel=True, cache=True)
def _find_parallel(slots, ids, queries, out):
    mask = np.uint64(slots.size - 1)
    for i in prange(queries.size):
        out[i] = _find(slots, ids, queries[i], mask)


def find_rows(slots: np.ndarray, ids: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """The row of each query id, or -1 where it is not stored."""
    out = np.empty(queries.size, np.int64)
    (_find_parallel if queries.size >= PARALLEL_FROM else _find_serial)(slots, ids, queries, out)
    return out


@njit(cache=True)
def gather_rows(rows, floats, places, touched, touched_place, table):
    """Fill ``table`` (float64, a row per query) with the stored rows ``rows`` (-1: not stored, a row of NaN): the
    float32 columns ``floats`` into the table's columns ``places``, ``touched`` into ``touched_place``. One call
    for every column: a single-record read took 9 µs in a numpy operation per column, 4 µs this way."""
    for i in range(rows.size):
        row = rows[i]
        if row < 0:
            table[i, :] = np.nan
            continue
        for k in range(len(floats)):
            table[i, places[k]] = floats[k][row]
        table[i, touched_place] = touched[row]


@njit(cache=True)
def add_to_index(slots, ids, first_row):
    """Index rows ``first_row:`` of ``ids`` (new, unique ids) in a table with room for them."""
    mask = np.uint64(slots.size - 1)
    for row in range(first_row, ids.size):
        slot = _mix(ids[row]) & mask
        while slots[slot] != _EMPTY:
            slot = (slot + np.uint64(1)) & mask
        slots[slot] = row


@njit(cache=True)
def group_by_owner(destination, ranks):
    """(a stable order that groups the entries by owner, the entries per owner): a counting sort, O(n)."""
    counts = np.zeros(ranks, np.int64)
    for i in range(destination.size):
        counts[destination[i]] += 1
    next_slot = np.zeros(ranks, np.int64)
    for r in range(1, ranks):
        next_slot[r] = next_slot[r - 1] + counts[r - 1]
    order = np.empty(destination.size, np.int64)
    for i in range(destination.size):
        order[next_slot[destination[i]]] = i
        next_slot[destination[i]] += 1
    return order, counts


@njit(cache=True)
def combine_by_row(rows, deltas):
    """Sum the deltas of equal rows in the order given (the batch's global order): (unique rows, sums).

    No sort: a small open-addressing table from row to sum, sized to the batch
    (it stays in the cache, where a table over all the partition's rows would not).
    """
    capacity = 16
    while capacity < 2 * rows.size:
        capacity *= 2
    mask = np.uint64(capacity - 1)
    table = np.full(capacity, -1, np.int64)  # the slot of each row's sum
    unique = np.empty(rows.size, np.int64)
    sums = np.empty(rows.size, np.float32)
    count = 0
    for i in range(rows.size):
        row = rows[i]
        probe = _mix(row) & mask
        while table[probe] >= 0 and unique[table[probe]] != row:
            probe = (probe + np.uint64(1)) & mask
        slot = table[probe]
        if slot < 0:
            table[probe] = count
            unique[count] = row
            sums[count] = deltas[i]
            count += 1
        else:
            sums[slot] = np.float32(sums[slot] + deltas[i])
    return unique[:count], sums[:count]


@njit(parallel=True, cache=True)
def apply_deltas(strength, touched, rows, deltas, iteration):
    """``strength[row] += delta``, clamped to [0, 1], and the row's last-touched iteration set (rows unique)."""
    for i in prange(rows.size):
        row = rows[i]
        value = np.float32(strength[row] + deltas[i])
        strength[row] = min(max(value, np.float32(0.0)), np.float32(1.0))
        touched[row] = iteration


@njit(parallel=True, cache=True)
def decay(strength, rate):
    """``strength -= rate``, clamped to [0, 1], in place (the decay alone: ``iteration_pass`` fuses it)."""
    for i in prange(strength.size):
        value = np.float32(strength[i] - rate)
        strength[i] = min(max(value, np.float32(0.0)), np.float32(1.0))


@njit(inline="always", cache=True)
def _better(q1, id1, q2, id2):
    """Whether (q1, id1) ranks before (q2, id2): higher quality first, then the smaller id."""
    return q1 > q2 or (q1 == q2 and id1 < id2)


@njit(inline="always", cache=True)
def _sift_down(heap_q, heap_id, size):
    """Restore the heap whose root (the worst kept entry) was replaced."""
    position = 0
    while True:
        left = 2 * position + 1
        if left >= size:
            return
        worst = left
        right = left + 1
        if right < size and _better(heap_q[worst], heap_id[worst], heap_q[right], heap_id[right]):
            worst = right
        if _better(heap_q[position], heap_id[position], heap_q[worst], heap_id[worst]):
            heap_q[position], heap_q[worst] = heap_q[worst], heap_q[position]
            heap_id[position], heap_id[worst] = heap_id[worst], heap_id[position]
            position = worst
        else:
            return


@njit(inline="always", cache=True)
def _sift_up(heap_q, heap_id, position):
    while position > 0:
        parent = (position - 1) // 2
        if _better(heap_q[parent], heap_id[parent], heap_q[position], heap_id[position]):
            heap_q[parent], heap_q[position] = heap_q[position], heap_q[parent]
            heap_id[parent], heap_id[position] = heap_id[position], heap_id[parent]
            position = parent
        else:
            return


@njit(parallel=True, cache=True)
def iteration_pass(strength, quality, ids, rate, low, high, bins, k, parts):
    """Decay and the quality aggregates in one pass; see the module's docstring. Per part (thread):

    (count, maximum, histogram, exponent bins, top-k qualities, top-k ids, top-k sizes).
    """
    n = strength.size
    histogram = np.zeros((parts, bins), np.int64)
    exponents = np.zeros((parts, EXPONENT_BINS), np.int64)
    maximum = np.full(parts, -np.inf, np.float64)
    heap_q = np.empty((parts, max(k, 1)), np.float32)
    heap_id = np.empty((parts, max(k, 1)), np.int64)
    kept = np.zeros(parts, np.int64)
    scale = bins / (high - low)
    bits = quality.view(np.uint32)
    for part in prange(parts):
        start = part * n // parts
        stop = (part + 1) * n // parts
        # this part's own counters (not rows of the shared outputs: threads writing neighbouring
        # words at every record share cache lines, which made the pass 2x slower)
        local_histogram = np.zeros(bins, np.int64)
        local_exponents = np.zeros(EXPONENT_BINS, np.int64)
        local_q = np.empty(max(k, 1), np.float32)
        local_id = np.empty(max(k, 1), np.int64)
        local_max = -np.inf
        size = 0
        for i in range(start, stop):
            value = np.float32(strength[i] - rate)
            strength[i] = min(max(value, np.float32(0.0)), np.float32(1.0))
            q = quality[i]
            local_max = max(local_max, q)
            x = (q - low) * scale  # clamped as a float: int() of a huge quality overflows
            local_histogram[0 if x < 0 else (bins - 1 if x >= bins else int(x))] += 1
            word = bits[i]
            exponent = (word >> 23) & 0xFF
            mantissa = np.int64(word & 0x7FFFFF)
            if exponent:
                mantissa |= 0x800000
            local_exponents[exponent] += -mantissa if word >> 31 else mantissa
            if k:
                if size < k:
                    local_q[size] = q
                    local_id[size] = ids[i]
                    _sift_up(local_q, local_id, size)
                    size += 1
                elif _better(q, ids[i], local_q[0], local_id[0]):
                    local_q[0] = q
                    local_id[0] = ids[i]
                    _sift_down(local_q, local_id, size)
        maximum[part] = local_max
        histogram[part] = local_histogram
        exponents[part] = local_exponents
        heap_q[part] = local_q
        heap_id[part] = local_id
        kept[part] = size
    return n, maximum, histogram, exponents, heap_q, heap_id, kept


@dataclass
class PassOutput:
    """The iteration's pass over one partition, on any device: what the store sums and merges over ranks."""

    count: int
    maximum: float
    histogram: np.ndarray  # (bins,)
    exponents: np.ndarray  # (EXPONENT_BINS,) summed mantissas
    candidates_quality: np.ndarray  # a superset of the partition's top-k
    candidates_ids: np.ndarray


def fused_pass(strength, quality, ids, rate: np.float32, low: float, high: float, bins: int, k: int) -> PassOutput:
    """``iteration_pass`` with one part per Numba thread, its parts combined."""
    parts = default_parts()
    count, maximum, histogram, exponents, heap_q, heap_id, kept = iteration_pass(
        strength, quality, ids, rate, low, high, bins, k, parts
    )
    return PassOutput(
        count=count,
        maximum=float(maximum.max(initial=-np.inf)),
        histogram=histogram.sum(axis=0),
        exponents=exponents.sum(axis=0),
        candidates_quality=np.concatenate([heap_q[p, : kept[p]] for p in range(parts)]),
        candidates_ids=np.concatenate([heap_id[p, : kept[p]] for p in range(parts)]),
    )


def default_parts() -> int:
    """Parts of ``iteration_pass``: one per Numba thread."""
    return max(1, get_num_threads())


def exact_total(exponent_bins: np.ndarray) -> float:
    """The correctly rounded sum of the values binned by ``iteration_pass`` (bins summed over parts and ranks)."""
    total = 0
    for exponent, mantissas in enumerate(np.asarray(exponent_bins, np.int64).tolist()):
        if mantissas:
            total += mantissas << max(exponent, 1)
    return total / (1 << 150) if total else 0.0  # Python's int / int is correctly rounded
