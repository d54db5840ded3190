"""A plain mpi4py program that imports mpiscale and ends normally on every rank; rank 0 prints where the job's
markers of a normal end go and their names' start (``host_markers``), for the test to look for them after."""

from mpi4py import MPI

import mpiscale  # noqa: F401  (its import under a launcher notes the rank's normal end)
from mpiscale.host_markers import folder, marker_prefix

MPI.COMM_WORLD.Barrier()
if MPI.COMM_WORLD.Get_rank() == 0:
    print(folder(), marker_prefix("mpiscale-ended-"), flush=True)
