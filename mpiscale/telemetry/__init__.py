"""Live telemetry of a running job: reports aggregated over the ranks, published to MQTT or a JSON-lines file."""

from .control import LEVELS, Command
from .remote import JobEnded, new_id, send_command
from .schema import SCHEMA, problems, record
from .session import Telemetry, current, set_current
from .settings import TelemetrySettings, job_id, restart_count
from .watch import watch_broker, watch_file

__all__ = [
    "LEVELS",
    "SCHEMA",
    "Command",
    "JobEnded",
    "Telemetry",
    "TelemetrySettings",
    "current",
    "job_id",
    "new_id",
    "problems",
    "record",
    "restart_count",
    "send_command",
    "set_current",
    "watch_broker",
    "watch_file",
]
