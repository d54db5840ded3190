"""mpiscale: an actor-model async runtime on MPI for HPC batch jobs."""

from .runtime import (
    Actor,
    ActorGroup,
    ActorNotFound,
    ActorRef,
    ActorStopped,
    ActorSystem,
    AskTimeout,
    CollectiveMismatch,
    RemoteError,
    RemoteTraceback,
    RestartPolicy,
    RuntimeConfig,
    run,
)

__version__ = "0.1.0"

__all__ = [
    "Actor",
    "ActorGroup",
    "ActorNotFound",
    "ActorRef",
    "ActorStopped",
    "ActorSystem",
    "AskTimeout",
    "CollectiveMismatch",
    "RemoteError",
    "RemoteTraceback",
    "RestartPolicy",
    "RuntimeConfig",
    "run",
    "__version__",
]
