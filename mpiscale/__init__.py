"""mpiscale: an actor-model async runtime on MPI for HPC batch jobs.

The runtime's public API (``Actor``, ``ActorRef``, ...) is re-exported here.
``run`` is the runtime's, with the job's telemetry and hang detection around
``main`` (``mpiscale.runtime.run`` is the bare one); ``report_step`` tells
them how far this rank got.
"""

from . import runtime
from ._version import __version__
from .runtime import *  # noqa: F403  (the list lives in mpiscale.runtime.__all__)
from .telemetry import report_step
from .telemetry import run_watched as run  # noqa: F401  (listed through runtime.__all__)

__all__ = [*runtime.__all__, "__version__", "report_step"]
