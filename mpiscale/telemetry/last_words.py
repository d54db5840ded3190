"""A job's failure event when the rank that should send it is held: said by its node watch's process.

A rank whose Python is held (a thread blocked in a parallel HDF5 call keeps
the GIL) cannot report the node that was lost; its node sentry
(:mod:`mpiscale.runtime.node_sentry`) prints the line and calls ``speak``
here before it kills the rank. As the rank would have: rank 0 writes the
failure event and the ``failed`` status to its sink, and a rank that found
rank 0's node lost writes them in its place.
"""

from __future__ import annotations

import socket
from pathlib import Path

from .schema import record
from .settings import TelemetrySettings
from .sinks import FileSink, MqttSink, lost_status


def sink_in_rank_0s_place(
    settings: TelemetrySettings, job: str, command: str, ranks: int, file: Path
) -> MqttSink | FileSink:
    """Where rank 0 reports (its broker, or its file), for a writer other than rank 0's telemetry: a rank that found
    rank 0's node lost, or a held rank's node sentry."""
    if settings.broker is not None:
        return MqttSink(settings, job, lost_status(job, command, ranks, socket.gethostname()))
    sink = FileSink(file)
    sink.accept()
    return sink


def spec(job: str, command: str, ranks: int, rank: int, file: Path) -> dict:
    """What ``speak`` needs to know of a rank's telemetry (the broker's settings come from the environment)."""
    return {"job": job, "command": command, "ranks": ranks, "rank": rank, "file": str(file)}


async def speak(said: dict, detail: str, rank: int) -> None:
    """The failure event for ``rank``'s death with ``detail``, and the ``failed`` status, where rank 0 reports."""
    if said["rank"] != 0 and rank != 0:  # rank 0 is alive: it is the one that reports, held or not
        return
    job, host = said["job"], socket.gethostname()
    sink = sink_in_rank_0s_place(TelemetrySettings.from_env(), job, said["command"], said["ranks"], Path(said["file"]))
    sink.publish(record("event", job, event="failure", rank=rank, detail=detail))
    sink.publish(record("status", job, state="failed", command=said["command"], ranks=said["ranks"], host=host),
                 retain=True)  # fmt: skip
    await sink.close()
