"""``mpiscale train``: the data-parallel job, or the pipeline job when stages or micro-batches are set."""

from __future__ import annotations

from ..jobs import run_lifecycle
from ..runtime import ActorSystem
from .config import TrainConfig


async def train(system: ActorSystem, config: TrainConfig) -> dict:
    """Run the job on every rank; returns a summary (the same on every rank).

    Bad input (data, settings, output paths, checkpoints, another job on the
    same outputs) ends the job before the first step with one message and exit
    status 2, agreed by every rank; a checkpoint or results file that cannot be
    written ends it with status 1.
    """
    if config.pipelined:
        from .pipeline.job import prepare_pipeline

        return await run_lifecycle(system, "train", lambda: prepare_pipeline(system, config))
    from .data_parallel_job import prepare_data_parallel

    return await run_lifecycle(system, "train", lambda: prepare_data_parallel(system, config))
