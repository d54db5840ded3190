"""Runtime settings, read from ``MPISCALE_*`` environment variables.

Every knob has a default that works on a laptop and on a cluster node; the
trade-offs are documented in ``docs/architecture.md``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import Field, dataclass, fields
from types import ModuleType
from typing import Any

from ..ranks import MAX_MESSAGE_BYTES

_THREAD_LEVELS = ("single", "funneled", "serialized", "multiple")


@dataclass(frozen=True)
class RuntimeConfig:
    """How the runtime polls, chunks messages, groups ranks into nodes and shuts down."""

    #: After the last MPI activity, poll without sleeping for this long (µs).
    #: Longer = lower latency for bursts, more CPU spent while waiting.
    spin_us: int = 500
    #: After sending an ask to another rank, poll for its reply in the asker's own stack for up to this long (µs)
    #: when no other task is ready to run: a fast reply then costs no task switch. 0: await it at once.
    ask_spin_us: int = 100
    #: Awaiting a value another rank owes this one (a pipeline stage's next activation, a graph node's input), poll
    #: for it in the awaiting task's stack for up to this long (µs) before the engine's sleeping policy takes over:
    #: a value that comes soon costs no task switch. 0: await it at once.
    value_spin_us: int = 1000
    #: Longest sleep between polls of an idle rank (µs). Bounds the added
    #: latency of the first message after a quiet period, and the idle CPU use.
    max_sleep_us: int = 2000
    #: Messages whose parts add up to at most this many bytes travel as one MPI
    #: message; larger ones send each buffer separately, without a copy.
    inline_bytes: int = 65536
    #: Bytes of large (>= 1 MiB) receive buffers kept for reuse once user code
    #: drops them; 0 disables the pool (every large message gets fresh memory).
    pool_bytes: int = 256 << 20
    #: Largest single MPI message (bytes); bigger buffers are split, which is
    #: how messages over 2 GiB travel with an MPI-3 library.
    chunk_bytes: int = MAX_MESSAGE_BYTES
    #: Group ranks into "nodes" of this many consecutive ranks instead of asking
    #: MPI which ranks share memory; 0 = ask MPI. Lets one machine test hierarchy.
    ranks_per_node: int = 0
    #: Hierarchical allreduces of fewer bytes run as one MPI Allreduce over the world: below this size the stages'
    #: extra hand-offs cost more than they save (over TCP here they overtook MPI between 16 and 64 MiB).
    #: 0: the stages at every size.
    hierarchical_min_bytes: int = 32 << 20
    #: A hierarchical allreduce that is MPI's own Allreduce runs in pieces of at most this many bytes (0: whole).
    #: Open MPI's shared-memory Allreduce of 2 ranks fell from 8 to 2.7 GB/s past 16 MiB (its large-message
    #: algorithm): 33.6 MB took 12.3 ms whole and 4.0 ms in pieces of 8 MiB, 50 MB 18.4 and 6.4 ms (2026-11-28).
    allreduce_piece_bytes: int = 8 << 20
    #: Seconds a SIGTERM/SIGINT shutdown may spend draining before it exits anyway.
    shutdown_timeout_s: float = 10.0
    #: Seconds a job that stops on SIGTERM after its current step (with a checkpoint) has to reach that step's end
    #: before the rank drains as for any other signal. Under Slurm, keep it below KillWait (default 30 s).
    stop_grace_s: float = 20.0
    #: Check that all ranks pass the same shape, dtype and op to a collective.
    check_collectives: bool = True
    #: Seconds a checkpoint save may take before the job ends with a report (0: 120 s + 1 s per 20 MB).
    #: A rank stuck in collective I/O that another rank abandoned (full disk, quota) would wait forever.
    io_timeout_s: float = 0.0
    #: Seconds a rank waits in one collective before it asks the other ranks whether each will enter it (0: never).
    #: A rank that left ``main`` or waits in another operation then ends the job with a report naming every rank.
    collective_check_s: float = 30.0
    #: MPI thread level requested at initialisation.
    thread_level: str = "multiple"

    def __post_init__(self) -> None:
        if self.thread_level not in _THREAD_LEVELS:
            raise ValueError(f"MPISCALE_THREAD_LEVEL={self.thread_level!r}: use one of {', '.join(_THREAD_LEVELS)}")
        for name in (
            "spin_us",
            "ask_spin_us",
            "value_spin_us",
            "max_sleep_us",
            "inline_bytes",
            "ranks_per_node",
            "pool_bytes",
            "hierarchical_min_bytes",
            "allreduce_piece_bytes",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"MPISCALE_{name.upper()} must be >= 0, got {getattr(self, name)}")
        if self.chunk_bytes < 1:
            raise ValueError(f"MPISCALE_CHUNK_BYTES must be >= 1, got {self.chunk_bytes}")
        if self.shutdown_timeout_s <= 0:
            raise ValueError(f"MPISCALE_SHUTDOWN_TIMEOUT_S must be > 0, got {self.shutdown_timeout_s}")
        if self.stop_grace_s <= 0:
            raise ValueError(f"MPISCALE_STOP_GRACE_S must be > 0, got {self.stop_grace_s}")
        if not self.collective_check_s >= 0:
            raise ValueError(f"MPISCALE_COLLECTIVE_CHECK_S must be >= 0 (0: never), got {self.collective_check_s}")
        if self.io_timeout_s < 0:
            raise ValueError(f"MPISCALE_IO_TIMEOUT_S must be >= 0 (0: scaled to the bytes), got {self.io_timeout_s}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RuntimeConfig:
        """Build a config from ``MPISCALE_<FIELD>`` variables, defaults elsewhere."""
        source = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for field in fields(cls):
            raw = source.get(f"MPISCALE_{field.name.upper()}")
            if raw is not None:
                values[field.name] = _parse_field(raw, field)
        return cls(**values)

    @classmethod
    def setting(cls, name: str, environ: Mapping[str, str] | None = None) -> Any:
        """The one setting ``name`` from its ``MPISCALE_`` variable (else its default), checked as ``from_env``
        checks it: for a call made often that needs only it (a blocking call's check), where reading every variable
        took 20 µs; the same variable's value is checked once (a file call's check read it in 3-8 µs a call)."""
        return _checked_setting(name, (os.environ if environ is None else environ).get(f"MPISCALE_{name.upper()}"))


@functools.lru_cache(maxsize=256)
def _checked_setting(name: str, raw: str | None) -> Any:
    """``RuntimeConfig.setting``'s value of ``name`` from its variable's value ``raw`` (None: unset)."""
    field = next(field for field in fields(RuntimeConfig) if field.name == name)
    if raw is None:
        return field.default
    value: Any = _parse_field(raw, field)
    return getattr(RuntimeConfig(**{name: value}), name)


def _parse_field(raw: str, field: Field) -> object:
    try:
        return _parse(raw, field.type)
    except ValueError:
        raise ValueError(f"MPISCALE_{field.name.upper()}={raw!r} is not a valid {field.type}") from None


def _parse(raw: str, type_name: object) -> object:
    kind = str(type_name)
    if kind == "bool":
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(raw)
    if kind == "int":
        return int(raw)
    if kind == "float":
        return float(raw)
    return raw


def load_mpi(config: RuntimeConfig) -> ModuleType:
    """Import ``mpi4py.MPI`` with the configured thread level (initialises MPI once)."""
    import sys

    if "mpi4py.MPI" not in sys.modules:
        import mpi4py

        mpi4py.rc.thread_level = config.thread_level
    from mpi4py import MPI

    return MPI
