"""The other ranks of this host, by process: which of them have died.

A rank killed by a signal (the out-of-memory killer, a crash) makes the
launcher end the job with SIGTERM to the others: srun ends the step that way
(then SIGKILL only KillWait seconds later, 30 by default), and mpirun too.
A healthy job takes SIGTERM as a request to stop after its step with a
checkpoint; a step that needs the dead rank never ends. So when a SIGTERM
comes, a rank looks for a dead rank on its host, and if one is gone it ends
the job at once, naming it. Ranks on other hosts cannot be seen this way.

Only ranks whose process this one could see at start-up are watched, so a
process namespace per rank (some containers) never looks like a death.
"""

from __future__ import annotations

from dataclasses import dataclass

from .death_watch import alive


@dataclass(frozen=True)
class LocalPeers:
    """rank -> pid of the other ranks on this host that this process can see."""

    pids: dict[int, int]

    @classmethod
    def of(cls, placement: list[tuple[str, int]], rank: int) -> LocalPeers:
        """The peers of ``rank`` in ``placement``: every rank's (host, pid), gathered at start-up."""
        host = placement[rank][0]
        return cls({r: pid for r, (where, pid) in enumerate(placement) if where == host and r != rank and alive(pid)})

    def gone(self) -> dict[int, int]:
        """rank -> pid of the watched ranks whose process has ended."""
        return {rank: pid for rank, pid in self.pids.items() if not alive(pid)}
