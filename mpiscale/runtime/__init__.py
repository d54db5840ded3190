"""The actor runtime on MPI. Knows nothing about ML, HDF5 or MQTT."""

from .actor import Actor, ActorGroup, ActorRef, RestartPolicy, current_system
from .collectives import Communicator, Hierarchy
from .config import RuntimeConfig
from .errors import (
    ActorNotFound,
    ActorStopped,
    AskTimeout,
    CollectiveMismatch,
    JobRefused,
    RemoteError,
    RemoteTraceback,
    TransportError,
)
from .narrow import bfloat16_bits, bfloat16_values, float16_bits, float16_values
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
    "TransportError",
    "bfloat16_bits",
    "bfloat16_values",
    "current_system",
    "float16_bits",
    "float16_values",
    "run",
]
