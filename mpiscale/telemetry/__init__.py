"""Live telemetry of a running job: reports aggregated over the ranks, published to MQTT or a JSON-lines file."""

from .schema import SCHEMA, problems, record
from .session import Telemetry, current, set_current
from .settings import TelemetrySettings, job_id, restart_count

__all__ = [
    "SCHEMA",
    "Telemetry",
    "TelemetrySettings",
    "current",
    "job_id",
    "problems",
    "record",
    "restart_count",
    "set_current",
]
