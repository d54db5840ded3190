"""Live telemetry of a running job: reports aggregated over the ranks, published to MQTT or a JSON-lines file."""

from .aggregate import by_node, pace, spread
from .control import LEVELS, Command, Rejected
from .remote import JobEnded, NoToken, new_id, send_command
from .schema import SCHEMA, problems, record
from .session import Telemetry, current, set_current
from .settings import TelemetrySettings, job_id, restart_count
from .token import read as read_token
from .watch import watch_broker, watch_file
from .watchdog import Finding, Watchdog, WatchdogSettings
from .watched import report_step
from .watched import run as run_watched

__all__ = [
    "LEVELS",
    "SCHEMA",
    "Command",
    "Finding",
    "JobEnded",
    "NoToken",
    "Rejected",
    "Telemetry",
    "TelemetrySettings",
    "Watchdog",
    "WatchdogSettings",
    "current",
    "job_id",
    "new_id",
    "pace",
    "problems",
    "read_token",
    "record",
    "report_step",
    "restart_count",
    "run_watched",
    "send_command",
    "set_current",
    "spread",
    "by_node",
    "watch_broker",
    "watch_file",
]
