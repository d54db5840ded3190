"""Planted failures, to rehearse them on your own cluster: ``MPISCALE_REHEARSE_FAILURE``.

``MPISCALE_REHEARSE_FAILURE="rank=2,iteration=25,lose-local"`` makes rank 2 of
``mpiscale memstore`` kill itself (SIGKILL, as the out-of-memory killer or a
dead node would) in the middle of iteration 25, after its updates are applied
and before they are committed; with ``lose-local`` it first deletes its
node's local directory, as if the node's disk were gone. ``hang=S`` instead
makes it stop there for S seconds (a stuck rank: its event loop blocked), and
``slow=S`` makes it S seconds slower in every iteration from there on (a
straggler). It fires only in a job's first run (``MPISCALE_RESTART_COUNT``
and ``SLURM_RESTART_COUNT`` unset or 0), so a restarted job goes on.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..telemetry import restart_count

VARIABLE = "MPISCALE_REHEARSE_FAILURE"


@dataclass(frozen=True)
class PlantedFailure:
    rank: int
    iteration: int
    lose_local: bool = False
    hang_s: float = 0.0
    slow_s: float = 0.0

    @property
    def kills(self) -> bool:
        """Whether the planted failure kills its rank (not a hang, not a straggler)."""
        return not (self.hang_s or self.slow_s)

    def strike(self, rank: int, iteration: int, local: Path | None) -> None:
        """Fail here if this is the rank and the iteration (from the iteration on, for ``slow``)."""
        if rank != self.rank or iteration < self.iteration:
            return
        if self.slow_s:
            time.sleep(self.slow_s)
        elif iteration == self.iteration and self.hang_s:
            time.sleep(self.hang_s)
        elif iteration == self.iteration:
            fail_now(rank, iteration, local if self.lose_local else None)


def planted_failure() -> PlantedFailure | None:
    """The failure the environment asks for in this run, or None."""
    text = os.environ.get(VARIABLE, "").strip()
    if not text or restart_count():
        return None
    fields = dict(part.partition("=")[::2] for part in text.split(","))
    try:
        return PlantedFailure(
            int(fields["rank"]), int(fields["iteration"]), "lose-local" in fields,
            float(fields.get("hang", 0)), float(fields.get("slow", 0)),
        )  # fmt: skip
    except (KeyError, ValueError):
        raise ValueError(
            f"{VARIABLE}={text!r}: expected 'rank=R,iteration=T' and one of 'lose-local', 'hang=S', 'slow=S'"
        ) from None


def fail_now(rank: int, iteration: int, local: Path | None) -> None:
    """Die as a killed rank does; with ``local``, delete that directory first."""
    if local is not None:
        shutil.rmtree(local, ignore_errors=True)
    print(f"mpiscale: rehearsal: rank {rank} is killed in iteration {iteration} at {time.time():.3f}", file=sys.stderr)
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)
