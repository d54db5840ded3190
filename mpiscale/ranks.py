"""Plain-MPI helpers that every layer shares: which rows a rank holds, its host and node, all-or-none failure.

The lowest layer with ``mpiscale.errors``: it imports nothing else of the
package, and works on raw mpi4py communicators (the runtime's
``Communicator`` wraps one as ``.comm``). Functions marked *collective* must be
called by every rank of the communicator. mpi4py is imported inside the
functions that need it, so importing this module does not start MPI.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, TypeVar, overload

from .errors import MpiscaleError
from .words import ranks_named

if TYPE_CHECKING:  # mpi4py is imported where MPI is used, so that importing this module does not start MPI
    from mpi4py.MPI import Comm as MPIComm

    class WrapsComm(Protocol):
        """The runtime's ``Communicator`` (``system.world``), seen from below: it wraps an mpi4py communicator."""

        @property
        def comm(self) -> MPIComm: ...

    Comm: TypeAlias = MPIComm
    AnyComm: TypeAlias = MPIComm | WrapsComm
else:
    Comm = AnyComm = Any

# ``Comm``: an mpi4py communicator. ``AnyComm``: that, or the runtime's ``Communicator`` (``system.world``):
# what io and the workloads accept where they take a ``comm``; ``as_mpi`` gives the mpi4py communicator underneath.

COUNT_LIMIT = 2**31 - 1
"""The most elements one MPI call may count (a C ``int``)."""

MAX_MESSAGE_BYTES = 1 << 30
"""Largest piece one message carries: buffers over 2 GiB go as several, whatever the MPI library."""


@overload
def as_mpi(comm: AnyComm) -> Comm: ...
@overload
def as_mpi(comm: None) -> None: ...
def as_mpi(comm: AnyComm | None) -> Comm | None:
    """The mpi4py communicator of ``comm`` (a runtime ``Communicator`` wraps one as ``.comm``); None stays None."""
    wrapped = getattr(comm, "comm", None)
    return comm if wrapped is None else wrapped  # type: ignore[return-value]  # a WrapsComm has a comm


#: Where launchers (mpirun, srun, hydra) put a process's rank, before MPI starts.
RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")


def launched_rank() -> int:
    """This process's rank as the launcher set it (mpirun, srun, hydra), before MPI starts; 0 when not launched."""
    for variable in RANK_VARIABLES:
        if os.environ.get(variable, "").isdigit():
            return int(os.environ[variable])
    return 0


class LaunchError(MpiscaleError, RuntimeError):
    """The tasks of this job cannot form one MPI job (``srun_tasks.launch_problem`` says why): raised before MPI
    starts."""


def end_job_on_uncaught() -> None:
    """Make an exception that no code catches end every rank of the MPI job, after Python's report of it: without
    this the failing rank's exit finalizes MPI (mpi4py's exit hook), and the other ranks wait for it in their next
    collective for ever (``python -m mpi4py`` does the same; a rank's ``FileNotFoundError`` before the estimator's
    ``fit`` left the other waiting until the launcher's timeout). Only where ``sys.excepthook`` is Python's own (a
    program's or a notebook's hook stays), and it aborts only where MPI runs with several ranks."""
    if sys.excepthook is sys.__excepthook__:
        sys.excepthook = report_and_abort


#: A failure every rank raised alike: how long the others wait for the reporting rank's report and abort.
AGREED_REPORT_S = 3.0


def reported_by_another(error: BaseException, rank: int, size: int) -> int | None:
    """The world rank whose report stands for ``error`` where every rank raised it alike (its ``reporter``, set by
    the code that raised it on every rank) and that is not ``rank``; else None."""
    reporter = getattr(error, "reporter", None)
    return reporter if isinstance(reporter, int) and reporter != rank and 0 <= reporter < size else None


def reported_line(rank: int, error: BaseException, reporter: int) -> str:
    """What a rank says of ``error`` whose report is ``reporter``'s: one line, not a second traceback."""
    return f"mpiscale: rank {rank}: {type(error).__name__}: {str(error)[:200]} (the report is rank {reporter}'s)"


def report_and_abort(kind: type[BaseException], error: BaseException, trace: Any) -> None:
    """Python's report of ``error`` that no code caught, then every rank of the job ended, where MPI runs with
    several ranks (``end_job_on_uncaught``'s hook). An error every rank raised alike is reported by its reporter
    alone: the other ranks wait for its abort, and say one line if it does not come."""
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() < 2:
        sys.__excepthook__(kind, error, trace)
        return
    leave_report_to_another(MPI, error)  # every rank raised it: the reporter's traceback stands for all
    sys.__excepthook__(kind, error, trace)
    end_every_rank(MPI, f"mpiscale: rank {MPI.COMM_WORLD.Get_rank()}: {kind.__name__} that no code caught: ending "
                   "every rank of the job (the others would wait for this one for ever)")  # fmt: skip


def leave_report_to_another(MPI: Any, error: BaseException) -> None:
    """Where every rank raised ``error`` alike and another rank is its reporter: wait for that rank's report and
    abort (which usually ends this rank first), else say one line and end every rank. Returns where this rank is
    the reporter, or none is named."""
    rank = MPI.COMM_WORLD.Get_rank()
    reporter = reported_by_another(error, rank, MPI.COMM_WORLD.Get_size())
    if reporter is not None:
        time.sleep(AGREED_REPORT_S)
        end_every_rank(MPI, reported_line(rank, error, reporter))


def end_every_rank(MPI: Any, message: str) -> None:
    """Say ``message`` on stderr and abort every rank of the job (status 1): for a rank that knows a wait would
    never end, its own or the others'."""
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    MPI.COMM_WORLD.Abort(1)


def size_and_rank(comm: Comm | None) -> tuple[int, int]:
    """``(size, rank)`` of ``comm``; ``(1, 0)`` without one (a serial caller)."""
    return (1, 0) if comm is None else (comm.Get_size(), comm.Get_rank())


def block_rows(total: int, parts: int) -> list[int]:
    """Rows of each of ``parts`` consecutive blocks of ``total`` rows, as ``np.array_split`` splits them."""
    base, extra = divmod(total, parts)
    return [base + (part < extra) for part in range(parts)]


def balanced_starts(weights: Sequence[int], stages: int) -> list[int]:
    """Where each of ``stages`` non-empty consecutive parts of ``weights`` starts, so that the heaviest part
    is as light as possible (of the cuts that achieve it, the earliest)."""
    n = len(weights)
    prefix = [0]
    for weight in weights:
        prefix.append(prefix[-1] + weight)
    inf = float("inf")
    # best[k][i]: the lightest heaviest part when the first i items form k parts; cut[k][i]: where the last begins
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                heaviest = max(best[k - 1][j], prefix[i] - prefix[j])
                if heaviest < best[k][i]:
                    best[k][i], cut[k][i] = heaviest, j
    starts, end = [], n
    for k in range(stages, 0, -1):
        end = cut[k][end]
        starts.append(end)
    return starts[::-1]


def rank_rows(total: int, size: int, rank: int) -> tuple[int, int]:
    """Row range ``[start, stop)`` of ``rank`` when ``total`` rows are split into ``size`` blocks."""
    rows = block_rows(total, size)
    start = sum(rows[:rank])
    return start, start + rows[rank]


def chunks(part: memoryview, chunk_bytes: int = MAX_MESSAGE_BYTES) -> Iterator[memoryview]:
    """Split a byte buffer into pieces of at most ``chunk_bytes`` (at least one piece)."""
    if part.nbytes == 0:
        yield part
        return
    for start in range(0, part.nbytes, chunk_bytes):
        yield part[start : start + chunk_bytes]


def host_placement(comm: Comm) -> tuple[int, int]:
    """(this rank's index among the ranks on its host, how many ranks share the host); collective.

    The real host (its memory and cores), even when nodes are simulated with ``ranks_per_node``.
    """
    from mpi4py import MPI

    host = comm.Split_type(MPI.COMM_TYPE_SHARED)
    placement = host.Get_rank(), host.Get_size()
    host.Free()
    return placement


def ranks_sharing_cores(comm: Comm) -> int:
    """How many ranks of this host may run on this rank's cores, itself included (collective).

    1 when the launcher bound each rank to cores of its own (``srun
    --cpus-per-task``, ``mpirun --bind-to core``); every rank of the host when
    they are unbound and share all its cores.
    """
    from mpi4py import MPI

    host = comm.Split_type(MPI.COMM_TYPE_SHARED)
    mine = os.sched_getaffinity(0)
    sharing = sum(1 for other in host.allgather(mine) if other & mine)
    host.Free()
    return sharing


def rendezvous(comm: Comm) -> tuple[str, int]:
    """An address of ``comm``'s first rank and a free port there, the same on every rank (collective): where a
    library that meets over TCP (torch.distributed) makes its group. The first rank's own address, so that ranks on
    other hosts reach it; the loopback where its host name resolves to nothing."""
    import socket

    address = port = None
    if comm.Get_rank() == 0:
        try:
            address = socket.gethostbyname(socket.gethostname())
        except OSError:  # a host name nothing resolves: one host then
            address = "127.0.0.1"
        with socket.socket() as probe:
            probe.bind((address, 0))
            port = probe.getsockname()[1]
    return comm.bcast((address, port), 0)


def split_nodes(comm: Comm, ranks_per_node: int = 0) -> tuple[Comm, int, int, tuple[int, ...]]:
    """Split ``comm`` by node (collective): returns (node communicator, node index, node count, each rank's node's
    lowest rank).

    Nodes are the shared-memory domains, or blocks of ``ranks_per_node``
    consecutive world ranks when that is set (to simulate several nodes on one
    machine; a communicator over some of the ranks splits as the world does).
    Nodes are numbered in the order of their lowest rank.
    """
    from mpi4py import MPI

    rank = comm.Get_rank()
    if ranks_per_node:
        node_comm = comm.Split(MPI.COMM_WORLD.Get_rank() // ranks_per_node, rank)
    else:
        node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, rank)
    first = node_comm.bcast(rank, 0)  # the node's lowest rank (node ranks follow world order)
    every = tuple(comm.allgather(first))
    firsts = sorted(set(every))
    return node_comm, firsts.index(first), len(firsts), every


T = TypeVar("T")

#: What each rank must do, said to a rank waiting alone in a collective call (``runtime.blocking_entry``).
EACH_RANK = "each rank of the comm given must"

#: How a collective call every rank must make waits for them first: ``runtime.blocking_entry``, which says a wait
#: that would never end and ends it; and how the ranks that entered a call together learn which failed in it:
#: ``runtime.entered_failures``. Set as the runtime is imported (this module sits below it).
_ENTRIES: list[Callable[..., list[int]]] = []
_ENTERED: list[Callable[[Comm, str, str | None], list[int]]] = []


def wait_at_entries(wait: Callable[..., list[int]], failures: Callable[[Comm, str, str | None], list[int]]) -> None:
    """Make ``on_rank_0`` and ``agree`` start with ``wait(comm, what, doing, mine=...)``, which returns every rank's
    ``mine`` once every rank of ``comm`` came (or raises where one came to another collective call), and ``agree``
    of a call the ranks entered together with ``failures(comm, what, this rank's problem)``: 1 for each rank with
    one."""
    _ENTRIES[:], _ENTERED[:] = [wait], [failures]


def on_rank_0(comm: Comm | None, action: Callable[[], T], refusals: tuple[type[Exception], ...] = (ValueError,)) -> T:
    """``action()`` run by rank 0 alone (listing files, reading an index, judging an earlier run's file), its result
    or its refusal on every rank (collective).

    A decision one rank makes must reach every rank as the same outcome: the
    ranks never see different listings, and when rank 0 refuses (an exception
    of ``refusals``), every rank raises that exception, so the job ends with one
    clean refusal instead of the other ranks waiting for a result that never
    comes. An exception that would not survive the trip keeps its type's base
    among ``refusals`` and its message.
    """
    result, problem = None, None
    if comm is not None and comm.Get_size() > 1 and _ENTRIES:  # (rank 0 alone passed a small one, sent to nobody)
        _ENTRIES[0](comm, f"on_rank_0({getattr(action, '__name__', type(action).__name__)})", "call it")
    if comm is None or comm.Get_rank() == 0:
        try:
            result = action()
        except refusals as error:
            problem = _travelling(error, refusals)
    if comm is not None:
        result, problem = comm.bcast((result, problem), 0)
    if problem is not None:
        raise problem
    return result  # type: ignore[return-value]  # set wherever no problem was raised


def _travelling(error: Exception, refusals: tuple[type[Exception], ...]) -> Exception:
    """``error``, or the first of ``refusals`` it is with its message, when it could not be rebuilt on another rank."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # an exception whose __init__ takes other arguments than its message
        kind = next(kind for kind in refusals if isinstance(error, kind))
        return kind(str(error))


class AgreedError(MpiscaleError, RuntimeError):
    """A failure every rank raised together (``agree``'s default kind), so collective clean-up is safe."""


def agree(
    comm: Comm | None,
    problem: BaseException | str | None,
    what: str,
    kind: type[Exception] = AgreedError,
    entered: bool = False,
) -> None:
    """All ranks go on, or all raise ``kind`` naming every failing rank (collective, blocking).

    Without a ``comm``, this process alone. The blocking form, for threads and set-up code outside the event loop;
    ``Communicator.agree`` is its awaitable twin, and ``ActorSystem.agree`` ends a job with one message and a status.
    A rank alone in it (the others never call it) is said and ended as one alone in ``on_rank_0`` is, not left
    waiting; ``entered``: every rank is known to have come to the call this agreement ends (it began with a checked
    entry), so the ranks exchange whether they have a problem at once, in one exchange the runtime does not watch
    (``runtime.entered_failures``: a rank with one ends the job where the others never come).
    """
    mine = problem_text(problem)
    messages = _said_by_each(comm, mine, what, entered)
    raise_agreed(messages, problem, what, kind, lambda: world_ranks(comm))


def _said_by_each(comm: Comm | None, mine: str | None, what: str, entered: bool) -> list[str | None]:
    """Each rank's problem (None where it has none): unless ``entered``, first whether each has one, carried by the
    checked entry ``on_rank_0`` starts with too, then, only where one has, the messages."""
    if comm is None:
        return [mine]
    if comm.Get_size() == 1 or not _ENTRIES:
        return comm.allgather(mine)
    if entered:
        failing = _ENTERED[0](comm, what, mine)
    else:
        failing = _ENTRIES[0](comm, f"agree({what})", "agree", mine=int(mine is not None))
    return comm.allgather(mine) if any(failing) else [None] * len(failing)


def problem_text(problem: BaseException | str | None) -> str | None:
    """What a rank says of its problem: the message, with the exception's type unless the message names it."""
    if isinstance(problem, BaseException):
        name = type(problem).__name__
        return f"{name}: {problem}" if name not in str(problem) else str(problem)
    return problem or None


def raise_agreed(
    messages: list[str | None],
    problem: BaseException | str | None,
    what: str,
    kind: type[Exception],
    ranks: Callable[[], Sequence[int]] | None = None,
) -> None:
    """Raise ``kind`` naming every rank with a message (a message said by many ranks, once); nothing if none.
    ``ranks()``: the world rank of each message's rank (for a part of the world's ranks), asked only then."""
    if not any(messages):
        return
    said = by_ranks(messages, None if ranks is None else ranks())
    raise kind(f"{what} failed: {said}") from problem if isinstance(problem, BaseException) else None


def world_ranks(comm: Comm | None) -> tuple[int, ...]:
    """The world rank of each member of ``comm``, in its rank order (the job's ranks, as every line of the job names
    them); ``(0,)`` without one (a serial caller)."""
    if comm is None:
        return (0,)
    from mpi4py import MPI

    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return tuple(int(r) for r in MPI.Group.Translate_ranks(group, list(range(comm.Get_size())), world))
    finally:
        group.Free()
        world.Free()


def by_ranks(messages: Sequence[str | None], ranks: Sequence[int] | None = None) -> str:
    """``rank 1: x; ranks 0, 2: y``: each message once, with the ranks that said it (``ranks[i]`` said
    ``messages[i]``: their world ranks, where a part of the world's ranks said them; by default the positions);
    empty if none."""
    ranks_of: dict[str, list[int]] = {}
    for other, message in enumerate(messages):
        if message:
            ranks_of.setdefault(message, []).append(other if ranks is None else ranks[other])
    return "; ".join(f"{ranks_named(where)}: {message}" for message, where in ranks_of.items())


def run_agreed(
    comm: Comm, what: str, action: Callable[[], object], kind: type[Exception] = AgreedError, entered: bool = False
) -> None:
    """Run ``action`` on this rank; if it raised on any rank, raise ``kind`` on every rank (collective; ``entered``
    as ``agree`` takes it)."""
    error = None
    try:
        action()
    except Exception as failure:  # agreed below, so every rank raises
        error = failure
    agree(comm, error, what, kind, entered)
