"""``mpiscale.run``: a user's job on the runtime, watched as the project's own jobs are.

The job gets the same telemetry session as ``mpiscale dictlearn`` and the
rest: records to the broker or a JSON-lines file, a heartbeat, hang and
straggler detection (``MPISCALE_HANG_*``), the ``dump`` and ``log-level``
commands, a ``failure`` event when a rank dies. ``report_step`` tells it how
far this rank got; a job that never calls it is still watched, with its step
left at 0.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from ..runtime import ActorSystem, MainNotAsync, RuntimeConfig
from ..runtime import run as run_bare
from .session import Telemetry, current, set_current

T = TypeVar("T")


def run(
    main: Callable[[ActorSystem], Awaitable[T]], *, name: str | None = None, config: RuntimeConfig | None = None
) -> T:
    """Run ``await main(system)`` on every rank, as ``mpiscale.runtime.run`` does, with the job's telemetry.

    ``name`` is what telemetry calls the job (default: the script's name);
    without ``MPISCALE_BROKER`` its records go to ``NAME.telemetry.jsonl`` in
    the working directory. ``MPISCALE_TELEMETRY=0`` turns telemetry off.
    """
    command = name or _script_name()
    return run_bare(lambda system: _watched(system, command, main), config=config)


def report_step(step: int, total: int = 0, items: float = 0.0, phases: dict[str, float] | None = None) -> None:
    """This rank finished step ``step`` of ``total`` (0: unknown), having processed ``items`` more (for the rate)
    and spent ``phases`` seconds in its named phases. Cheap, not collective; nothing happens outside ``run``."""
    session = current()
    if session is not None:
        session.update(step, total, items, phases)


async def _watched(system: ActorSystem, command: str, main: Callable[[ActorSystem], Awaitable[T]]) -> T:
    session = await Telemetry.start(system, command, None)
    session.accept()  # a program of the user's has no checks to pass first
    # its last numbers are collective: the runtime runs this only once main returned (or exited 0) on every rank
    system.at_end(session.close)
    set_current(session)
    try:
        return await MainNotAsync.started(main, system)
    except BaseException as error:
        detail = _failure(error)
        if detail is not None:
            await session.fail(detail)
        raise
    finally:
        set_current(None)


def _failure(error: BaseException) -> str | None:
    """What the failure event says of how ``main`` ended (None: ``sys.exit(0)``, no failure)."""
    if isinstance(error, SystemExit):
        return None if error.code in (0, None) else f"exit status {error.code}"
    return f"{type(error).__name__}: {error}"


def _script_name() -> str:
    """The script's stem; for ``python -m package``, the package's name; for ``python -c``, "python"."""
    if not sys.argv or sys.argv[0] in ("", "-c", "-m"):
        return "python"
    script = Path(sys.argv[0])
    return script.parent.name if script.stem == "__main__" else script.stem
