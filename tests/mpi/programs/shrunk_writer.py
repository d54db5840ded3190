"""A growing data set cut back and written past the cut, as a resumed run does (``grow`` smaller drops what its
predecessor wrote after its last mark): 560 values written, cut to 480, then 480-560 written again in two rounds of
``grow`` and ``write``, each rank its share. Arguments: the directory, and ``reopened`` (the 560 in an earlier
writer, closed under a kept name and reopened, as a resume does), ``same`` (all in one writer) or ``refused``
(a negative count and a data set not made growing asked of ``grow`` first, each rank printing what it raised, the
writer going on). Rank 0 prints how many values differ from those written last."""

import sys
from pathlib import Path

import h5py
import numpy as np
from mpi4py import MPI

from mpiscale.io import RowWriter

DIRECTORY, HOW = Path(sys.argv[1]), sys.argv[2]
OUT, KEPT, CUT, END, ROUND = DIRECTORY / "out.h5", DIRECTORY / "out.h5.partial", 480, 560, 40
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()


def write_share(writer: RowWriter, lo: int, hi: int, values: np.ndarray) -> None:
    """Rows ``lo:hi`` of ``values`` (the whole data set's), this rank's share of them."""
    share = -(-(hi - lo) // size)
    mine_lo, mine_hi = min(lo + rank * share, hi), min(lo + (rank + 1) * share, hi)
    writer.grow({"x": hi})
    writer.write(mine_lo, {"x": values[mine_lo:mine_hi]})
    writer.flush()


first, last = np.arange(END, dtype=np.float64) + 1, -np.arange(END, dtype=np.float64) - 1
writer = RowWriter(OUT, {"x": ((0,), np.float64), "fixed": ((2,), np.float64)}, comm, growing=("x",))
write_share(writer, 0, END, first)
for refused in ({"x": -1}, {"x": 2.5}, {"fixed": 8}) if HOW == "refused" else ():
    try:
        writer.grow(refused)
    except (TypeError, ValueError) as error:
        print(f"rank {rank}: {type(error).__name__}: {error}", flush=True)
if HOW == "reopened":
    writer.close(KEPT)
    writer = RowWriter.reopen(OUT, KEPT, comm)
writer.grow({"x": CUT})
for lo in range(CUT, END, ROUND):
    write_share(writer, lo, lo + ROUND, last)
    writer.mark(rows_done=lo + ROUND)
    writer.flush()
writer.close()
if rank == 0:
    with h5py.File(OUT, "r") as file:
        found = file["x"][()]
    expected = np.concatenate([first[:CUT], last[CUT:]])
    print(f"{len(found)} values, {int((found != expected).sum())} differ", flush=True)
