"""Each batch's digest of the input rows it was computed from, kept in the output file beside its flag, so that
``--resume`` can tell the data its written batches came from from data written again under the same name since
(preprocessing run again, a file replaced): a resumed run checks the written batches' rows before it runs any."""

from __future__ import annotations

import numpy as np

from ..io import DataFileError, Fingerprint, ShardedDataset, refuse_unreadable
from ..ranks import Comm
from .work import Inputs

#: The output file's data set of the digests (``io.Fingerprint.weigh`` of a batch's rows), one per batch (0 for a
#: batch not yet written).
DIGESTS = "data_digests"


class DigestingReader:
    """Reads whole batches of ``data`` for a ``Work`` and keeps the digest of each batch it read."""

    def __init__(self, data: ShardedDataset, inputs: Inputs) -> None:
        self.data, self.inputs = data, inputs
        self._fingerprint = Fingerprint()
        self._digests: dict[int, int] = {}

    def read(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` (independent I/O), a batch's or none."""
        return self._taken(start, self.data.read(start, stop))

    def read_collective(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` with collective I/O (every rank calls, with its batch's rows or none)."""
        return self._taken(start, self.data.read_collective(start, stop))

    def gather(self, comm: Comm) -> dict[int, int]:
        """The digests of the batches every rank read since the last call, on rank 0 (collective; the other ranks
        get none)."""
        digests: dict[int, int] = {}
        for part in comm.gather(self._digests, root=0) or ():
            digests.update(part)
        self._digests = {}
        return digests

    def _taken(self, start: int, rows: np.ndarray) -> np.ndarray:
        if len(rows):
            batch = start // self.inputs.batch_size
            assert (start, start + len(rows)) == self.inputs.bounds(batch), "a work reads whole batches"
            self._digests[batch] = self._fingerprint.weigh(start, rows.reshape(len(rows), -1))
        return rows


def first_changed_batch(inputs: Inputs, written: list[int], stored: np.ndarray, comm: Comm) -> int | None:
    """The first of the ``written`` batches whose rows no longer give their ``stored`` digest, or None (collective:
    the ranks share the batches, each reading its own with independent I/O). A stored 0 is no digest (a kill
    between a step's digests and its flags reaching the disk): that batch is not checked."""
    changed, unreadable, fingerprint = None, None, Fingerprint()
    with ShardedDataset(inputs.path, inputs.name, comm) as data:
        for batch in written[comm.Get_rank() :: comm.Get_size()]:
            lo, hi = inputs.bounds(batch)
            try:
                rows = data.read(lo, hi) if stored[batch] else None
            except DataFileError as error:  # (refused below on every rank: none waits for this one)
                unreadable = (lo, error)
                break
            if rows is not None and fingerprint.weigh(lo, rows.reshape(hi - lo, -1)) != int(stored[batch]):
                changed = batch
                break
    refuse_unreadable(comm, unreadable)
    found = [batch for batch in comm.allgather(changed) if batch is not None]
    return min(found) if found else None
