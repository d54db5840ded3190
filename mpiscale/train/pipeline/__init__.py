"""Pipeline-parallel training: a model cut into stages, one per rank, micro-batches as raw tensors on a channel.

``split_sequential`` cuts an ``nn.Sequential``; ``Pipeline.start`` makes this rank's stage; the schedules
(``1f1b``, ``gpipe``) are compiled to one action list per stage and checked before the first step.
"""

from .schedule import SCHEDULES, Action, ScheduleError, build
from .split import split_sequential
from .stages import Pipeline, StepStats, stage_of

__all__ = [
    "SCHEDULES",
    "Action",
    "Pipeline",
    "ScheduleError",
    "StepStats",
    "build",
    "split_sequential",
    "stage_of",
]
