"""mpiscale: an actor-model async runtime on MPI for HPC batch jobs.

The runtime's public API (``Actor``, ``ActorRef``, ...) is re-exported here.
``run`` is the runtime's, with the job's telemetry and hang detection around
``main`` (``mpiscale.runtime.run`` is the bare one); ``report_step`` tells
them how far this rank got.
"""

import atexit as _atexit
import os as _os

from . import early_stop as _early_stop
from .ended_ranks import note_normal_end as _note_normal_end
from .ranks import RANK_VARIABLES as _RANK_VARIABLES
from .ranks import end_job_on_uncaught as _end_job_on_uncaught

if any(_os.environ.get(name) for name in _RANK_VARIABLES):
    _early_stop.hold()  # a launcher's rank: a stop while it starts is noted, not its silent death
    _end_job_on_uncaught()  # a rank's uncaught error ends the job, rather than leave the others waiting for it
    _atexit.register(_note_normal_end)  # (the last exit handler) a rank that waits for this one ends the job

from . import runtime  # noqa: E402  (after the signals are held: importing the runtime takes a while)
from ._version import __version__  # noqa: E402
from .runtime import *  # noqa: F403  (the list lives in mpiscale.runtime.__all__)
from .telemetry import report_step
from .telemetry import run_watched as run  # noqa: F401  (listed through runtime.__all__)

__all__ = [*runtime.__all__, "__version__", "report_step"]
