"""Move row blocks of arrays between ranks so that each rank ends up with the rows it wants.

Used to reshard a checkpoint: the ranks that could read a shard hold its rows,
and every rank asks for its own row range (any world size, any ranges). Every
rank derives the same list of transfers from two allgathers, posts them in the
same order, and waits; pieces over ``max_message`` bytes are split.
"""

from __future__ import annotations

import numpy as np

from ..ranks import MAX_MESSAGE_BYTES, chunks

_TAG = 23


def _bytes(rows: np.ndarray) -> memoryview:
    return memoryview(rows.reshape(-1).view(np.uint8))


def redistribute(
    comm,
    held: dict[str, list[tuple[int, np.ndarray]]],
    wanted: dict[str, tuple[int, int]],
    specs: dict[str, tuple[tuple[int, ...], np.dtype]],
    max_message: int = MAX_MESSAGE_BYTES,
) -> dict[str, np.ndarray]:
    """Collective: returns, for each name, rows ``wanted[name]`` gathered from every rank's ``held`` blocks.

    ``held[name]`` lists (first global row, rows) blocks this rank holds, and
    ``specs[name]`` gives the row shape and dtype of the result.
    Raises ValueError if some wanted row is held by nobody.
    """
    from mpi4py import MPI

    rank = comm.Get_rank()
    every_held = comm.allgather(
        {name: [(start, start + len(rows)) for start, rows in blocks if len(rows)] for name, blocks in held.items()}
    )
    every_wanted = comm.allgather(wanted)
    plan = {
        name: [(holder, *block) for holder, mine in enumerate(every_held) for block in mine.get(name, [])]
        for name in sorted(wanted)
    }
    _check_coverage(plan, every_wanted)  # the same verdict on every rank, before any transfer
    out: dict[str, np.ndarray] = {}
    requests = []
    for name, blocks in plan.items():
        row_shape, dtype = specs[name]
        start, stop = wanted[name]
        out[name] = np.empty((stop - start, *row_shape), dtype=np.dtype(dtype))
        for holder, block_start, block_stop in blocks:
            for target, target_wants in enumerate(every_wanted):
                lo, hi = max(block_start, target_wants[name][0]), min(block_stop, target_wants[name][1])
                if lo >= hi or rank not in (holder, target):
                    continue
                destination = out[name][lo - start : hi - start]
                if holder == rank:
                    source = _held_rows(held[name], block_start, block_stop, lo, hi)
                    if target == rank:
                        destination[...] = source
                        continue
                    for piece in chunks(_bytes(np.ascontiguousarray(source)), max_message):
                        requests.append(comm.Isend([piece, MPI.BYTE], target, _TAG))
                else:
                    for piece in chunks(_bytes(destination), max_message):
                        requests.append(comm.Irecv([piece, MPI.BYTE], holder, _TAG))
    MPI.Request.Waitall(requests)
    return out


def _check_coverage(plan: dict[str, list[tuple]], every_wanted: list[dict[str, tuple[int, int]]]) -> None:
    for name, blocks in plan.items():
        for target, target_wants in enumerate(every_wanted):
            start, stop = target_wants[name]
            covered = sum(max(0, min(b_stop, stop) - max(b_start, start)) for _, b_start, b_stop in blocks)
            if covered != stop - start:
                raise ValueError(f"rank {target} wants rows {start}:{stop} of {name!r}, but only {covered} are held")


def _held_rows(blocks: list[tuple[int, np.ndarray]], block_start: int, block_stop: int, lo: int, hi: int) -> np.ndarray:
    for start, rows in blocks:
        if start == block_start and start + len(rows) == block_stop:
            return rows[lo - start : hi - start]
    raise KeyError(block_start)
