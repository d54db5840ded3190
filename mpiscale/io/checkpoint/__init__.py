"""Collective, verified, multi-level checkpoints that reshard on restart.

``Checkpointer.save(step, sharded=..., replicated=..., meta=...)`` is
collective. Sharded arrays are this rank's rows of a global array; replicated
arrays are the same on every rank (rank 0's copy is saved); ``meta`` is small
JSON (step counters, RNG states, config). The arrays are copied into reusable
buffers and, by default, written by one background thread while compute goes
on; the next ``save``, ``load``, ``wait`` or ``close`` waits for it and raises
if it failed, on every rank.

Levels, after LLNL's Scalable Checkpoint/Restart:

1. ``local``: each rank's shard goes to node-local storage (``local_dir/node-K``);
2. ``partner``: the shard is also copied to a rank on the next node;
3. ``shared``: one parallel HDF5 file in the shared ``directory``, every
   ``shared_every`` saves (every save when there is no ``local_dir``).

A checkpoint counts only once every level of it is written and flushed and
rank 0 has renamed its manifest into place (then ``latest`` is updated).
``load`` takes the newest one it can read and verify: each shard from its own
node, else from the partner copy, else the whole step from the shared file;
a corrupt or lost checkpoint is reported and the previous one is used.
With ``delta=True`` a save stores only arrays whose contents changed since the
last full save (full saves come every ``full_every`` saves and always include
the shared level when there is one); ``load`` combines the two.

One module per job: ``checkpointer`` (the public ``Checkpointer``: checks,
snapshots, the background writer, commit), ``files`` (paths and the writing
and reading of each kind of file), ``manifest``, ``partners`` (level 2),
``retention`` and ``restore`` (loading and resharding).
"""

from .checkpointer import Checkpointer
from .restore import Restored

__all__ = ["Checkpointer", "Restored"]
