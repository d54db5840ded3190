"""mpiscale: an actor-model async runtime on MPI for HPC batch jobs.

The runtime's public API (``Actor``, ``ActorRef``, ``run``, ...) is re-exported here.
"""

from . import runtime
from ._version import __version__
from .runtime import *  # noqa: F403  (the list lives in mpiscale.runtime.__all__)

__all__ = [*runtime.__all__, "__version__"]
