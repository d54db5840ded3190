"""A plain mpi4py program that imports mpiscale and ends normally on every rank, after blocking calls on three
communicators besides the world's: a part of it (each pair of ranks), a copy then freed through another handle
of it, and a copy left as it is. Rank 0 prints where the job's markers of a normal end go and their names' start
(``host_markers``), for the test to look for them after, and the communicators its end will meet the others' on."""

from mpi4py import MPI

import mpiscale  # noqa: F401  (its import under a launcher notes the rank's normal end)
from mpiscale.host_markers import folder, marker_prefix
from mpiscale.ranks import agree
from mpiscale.runtime.used_comms import used_communicators

world = MPI.COMM_WORLD
pair, freed, kept = world.Split(world.Get_rank() // 2), world.Dup(), world.Dup()
for comm in (pair, freed, kept):
    agree(comm, None, "a blocking call on each")
MPI.Intracomm(freed).Free()  # (another handle of it: ``freed`` itself still holds the old one)
world.Barrier()
if world.Get_rank() == 0:
    print(folder(), marker_prefix("mpiscale-ended-"), len(used_communicators()), flush=True)
