"""The actor runtime on MPI. Knows nothing about ML, HDF5 or MQTT."""

from .actor import Actor, ActorGroup, ActorRef, RestartPolicy, current_system
from .collectives import CollectiveMismatch, Communicator, Hierarchy
from .config import RuntimeConfig
from .errors import ActorNotFound, ActorStopped, AskTimeout, JobRefused, RemoteError, RemoteTraceback
from .system import ActorSystem, run

__all__ = [
    "Actor",
    "ActorGroup",
    "ActorNotFound",
    "ActorRef",
    "ActorStopped",
    "ActorSystem",
    "AskTimeout",
    "CollectiveMismatch",
    "Communicator",
    "Hierarchy",
    "JobRefused",
    "RemoteError",
    "RemoteTraceback",
    "RestartPolicy",
    "RuntimeConfig",
    "current_system",
    "run",
]
