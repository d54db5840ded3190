"""The actor runtime on MPI. Knows nothing about ML, HDF5 or MQTT."""

from . import program_end  # noqa: F401  (a plain program's ranks meet at its end: its exit exchange)
from .abandoned import call_site
from .actor import Actor, ActorGroup, ActorRef, RestartPolicy, current_system
from .arrivals import Arrivals
from .blocking import blocking_barrier, blocking_collective, blocking_entry, checked_entry, end_job
from .channels import Channel
from .collectives import Communicator
from .config import RuntimeConfig
from .errors import (
    ActorNotFound,
    ActorStopped,
    AskTimeout,
    CollectiveAbandoned,
    CollectiveMismatch,
    JobRefused,
    MainNotAsync,
    MessageRefused,
    RemoteError,
    RemoteTraceback,
    TransportError,
)
from .hierarchy import Group, Hierarchy
from .lifecycle import run
from .steering import Orders, Steering
from .system import ActorSystem
from .wire import library_line, message_path

__all__ = [
    "Actor",
    "ActorGroup",
    "ActorNotFound",
    "ActorRef",
    "ActorStopped",
    "ActorSystem",
    "Arrivals",
    "Channel",
    "AskTimeout",
    "CollectiveAbandoned",
    "CollectiveMismatch",
    "Communicator",
    "Group",
    "Hierarchy",
    "JobRefused",
    "MainNotAsync",
    "MessageRefused",
    "Orders",
    "RemoteError",
    "RemoteTraceback",
    "RestartPolicy",
    "RuntimeConfig",
    "Steering",
    "TransportError",
    "blocking_barrier",
    "blocking_collective",
    "blocking_entry",
    "call_site",
    "checked_entry",
    "current_system",
    "end_job",
    "library_line",
    "message_path",
    "run",
]
