"""Exceptions the runtime raises, and how a remote failure is carried back."""

from __future__ import annotations

import functools
import hashlib
import inspect
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from ..errors import MpiscaleError


class RemoteTraceback(MpiscaleError):
    """The traceback of a failure on another rank, chained as ``__cause__``."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


class RemoteError(MpiscaleError, RuntimeError):
    """Stands in for a remote exception that could not be pickled."""


class JobRefused(MpiscaleError):
    """Every rank agreed that the job cannot go on (bad input or settings): raised on every rank.

    The runtime prints the message once (on rank 0), shuts every rank down
    cleanly and exits with ``status``: no ``MPI_Abort``, one message. Raise it
    through :meth:`ActorSystem.agree`, which makes sure every rank raises it.
    """

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


class MainNotAsync(JobRefused, TypeError):
    """``run(main)`` was given a ``main`` whose call gives no awaitable (a plain ``def``, not an ``async def``).

    Every rank runs the same ``main``, so every rank finds it: a refusal of the job, one message from rank 0 and
    exit status 2 (it was a failure report and traceback from each rank)."""

    def __init__(self, main: object, result: object) -> None:
        name = getattr(main, "__qualname__", repr(main))
        super().__init__(
            f"run(main) awaits main(system), but {name}(system) returned {type(result).__name__}, not an awaitable: "
            f"define it as `async def {name}(system)`, so its awaits let the ranks' messages through"
        )

    @classmethod
    def started(cls, main: Callable[[Any], Any], system: Any) -> Awaitable[Any]:
        """``main(system)``, refused with this error where it is no awaitable (both ways of running a main)."""
        result = main(system)
        if not inspect.isawaitable(result):
            raise cls(main, result)
        return result


class AskTimeout(MpiscaleError, TimeoutError):
    """An ``ask`` got no reply within its deadline."""


class ActorNotFound(MpiscaleError, LookupError):
    """No actor of that name lives on the addressed rank."""


class ActorStopped(MpiscaleError, RuntimeError):
    """The actor was stopped (or the system is shutting down) before it replied."""


class CollectiveMismatch(MpiscaleError, ValueError):
    """Ranks called different collectives, or passed different shapes, dtypes or operations to the same one.

    Raised on every rank of the communicator alike; ``reporter`` (a world rank, or None) is the one whose failure
    report stands for all of them when the job ends on it.
    """

    reporter: int | None = None


@functools.lru_cache(maxsize=1024)
def signature_digest(signature: str) -> int:
    """A signed 64-bit digest of a collective's arguments (shape, dtype, op), to compare across ranks."""
    return int.from_bytes(hashlib.blake2b(signature.encode(), digest_size=8).digest(), "little", signed=True)


class CollectiveAbandoned(MpiscaleError, RuntimeError):
    """A rank waits in a collective that another rank will never enter (it left ``main``, or called another one)."""


class TransportError(MpiscaleError, RuntimeError):
    """A frame that this runtime cannot decode (corrupt or from another program)."""


class MessageRefused(TransportError):
    """A message from rank ``source`` that this rank cannot take: damaged, foreign, beyond what it can hold, or
    declaring parts that never came. The job ends with one report that names the sender."""

    def __init__(self, source: int, detail: str) -> None:
        super().__init__(detail)
        self.source = source

    @classmethod
    def of(cls, source: int, error: BaseException) -> MessageRefused:
        """``error``, raised while taking in a message from ``source``, as the refusal of that message."""
        if isinstance(error, MessageRefused):
            return error
        detail = str(error) if isinstance(error, TransportError) else f"{type(error).__name__}: {error}"
        return cls(source, detail)


@dataclass
class Failure:
    """A handler's exception as it travels back to the asker."""

    error: BaseException
    traceback_text: str
    origin: str  # "rank 1 on host node07, actor 'worker' (Worker.step)"

    @classmethod
    def capture(cls, error: BaseException, origin: str) -> Failure:
        text = "".join(traceback.format_exception(error))
        return cls(error, text, origin)

    def picklable(self) -> Failure:
        """This failure, or a :class:`RemoteError` copy if the exception cannot be pickled."""
        import pickle

        try:
            pickle.dumps(self.error, protocol=5)
            return self
        except Exception:
            substitute = RemoteError(f"{type(self.error).__qualname__}: {self.error}")
            return Failure(substitute, self.traceback_text, self.origin)

    def raise_here(self) -> NoReturn:
        """Raise the original exception type, chained to the remote traceback."""
        cause = RemoteTraceback(f"\n\nRemote traceback from {self.origin}:\n\n{self.traceback_text}")
        raise self.error from cause
