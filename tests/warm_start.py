"""Warm starts for the tests' processes: a rank forked from a process that has already imported torch, numpy
and Numba (with its CPU target ready), instead of importing them again.

Most of the suite's CPU went into starting ranks: 2.3 s of a training rank and 1.2 s of a dictionary-learning one
are imports and Numba's target, and the suite starts about 700 ranks. A warm start runs the same program, with the
same arguments, environment, working directory and standard streams, under the same mpirun: only the imports are
done once, before the fork.

Two roles, one file:

- ``serve SOCKET`` is the *preloaded* process (one per test worker). It imports the heavy libraries but never MPI
  (an initialised MPI cannot be forked) nor HDF5, then forks a *keeper* per request. The keeper forks the *worker* (the
  rank itself: it sets the environment, the directory and the streams it was sent, then runs the program, whose
  first ``mpi4py`` import initialises MPI from the launcher's environment as a cold rank does) and relays between
  it and the stand-in: signals one way (``HOLD`` as SIGSTOP), the exit status the other; it kills the worker when
  the stand-in dies.
- ``SOCKET python-arguments...`` is the *stand-in*, the process mpirun (or a test) starts: stdlib only, about
  30 ms of CPU. It sends its arguments, environment, directory, streams 0-2 and namespaces, forwards the signals it
  gets, and exits as the worker did (its exit status, or the same signal).

A stand-in that mpirun starts on a node of the local cluster (``hpc/cluster``: a network, UTS and mount namespace)
has a worker that joins those namespaces before anything else: the rank has the node's hostname, address and
node-local disk, as a cold one would, and ``cluster.sh kill`` (every process of the node's network) takes it too.

Tests that check start-up itself (a stop while a rank imports, what ``--help`` imports, the first compile) start
cold: ``helpers.launch(..., cold=True)``, and ``MPISCALE_TESTS_COLD=1`` starts every process of the suite cold.
"""

from __future__ import annotations

import array
import atexit
import ctypes
import gc
import json
import os
import resource
import select
import signal
import socket
import struct
import sys
import types

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGCONT, signal.SIGALRM, signal.SIGTSTP)  # fmt: skip
HOLD = signal.SIGTSTP  # to a stand-in: its worker is stopped (SIGSTOP, which no process can catch to forward)
LIMITS = ("RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_CORE", "RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_CPU", "RLIMIT_NPROC")
# Variables the preloaded libraries read as they load (Numba's settings, OpenMP's and BLAS's threads, the
# interpreter's own): a request whose values differ from the preloaded process's starts cold, in the worker's place.
READ_AT_IMPORT = ("NUMBA_", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "TORCH", "PYTORCH_", "CUDA_", "PYTHON",
                  "LD_", "HDF5_", "MALLOC_")  # fmt: skip
NAMESPACES = ("net", "uts", "mnt")  # what a node of the local cluster is made of (hpc/cluster/cluster.sh)
_LENGTH = struct.Struct("!I")
_EVENT = struct.Struct("!ii")  # (kind, number): kind 0 exit status, 1 killed by signal, 2 a signal to forward


def stand_in(path: str, arguments: list[str]) -> None:
    """Run ``python ARGUMENTS`` in a worker forked from the preloaded process at ``path``; exit as it did."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(path)
    request = json.dumps({
        "argv": arguments, "env": dict(os.environ), "cwd": os.getcwd(), "umask": os.umask(0o022),
        "cpus": sorted(os.sched_getaffinity(0)),  # mpirun's binding, where it binds
        "limits": {name: resource.getrlimit(getattr(resource, name)) for name in LIMITS},
    }).encode()  # fmt: skip
    namespaces = [os.open(f"/proc/self/ns/{kind}", os.O_RDONLY) for kind in NAMESPACES]
    connection.sendmsg(
        [_LENGTH.pack(len(request)), request],
        [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2, *namespaces]))],
    )
    for descriptor in namespaces:
        os.close(descriptor)

    def forward(signum, _frame):
        try:
            connection.sendall(_EVENT.pack(2, signum))
        except OSError:  # the keeper is gone, after it sent how the worker ended: that is on its way, or here
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    kind, number = _EVENT.unpack(_receive(connection, _EVENT.size))
    if kind == 0:
        os._exit(number)
    for signum in FORWARDED:
        signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), number)
    os._exit(128 + number)


def _receive(connection: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        try:
            chunk = connection.recv(size - len(data))
        except InterruptedError:
            continue
        if not chunk:
            return _EVENT.pack(1, signal.SIGKILL)  # the keeper is gone: so is the worker
        data += chunk
    return data


def serve(path: str) -> None:
    """Preload, then fork a keeper for every stand-in that connects, until the test worker that started us ends."""
    _preload()
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(f"{path}.new")
    listener.listen(64)
    os.rename(f"{path}.new", path)  # the path appears listening: a stand-in never finds it bound but refusing
    while os.getppid() == parent:
        ready, _, _ = select.select([listener], [], [], 1.0)
        _reap()
        if not ready:
            continue
        connection, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            _keep(connection)
        connection.close()


def _preload() -> None:
    """What a rank of this suite imports before it does anything, but MPI and HDF5: HDF5 must start after MPI, as
    in a rank that imports mpi4py first, to close its files when MPI finalizes rather than after."""
    import numba
    import numba.cuda  # noqa: F401  (the module, not the driver: every kernel job asks whether a GPU is there)
    import numpy  # noqa: F401
    import scipy.linalg  # noqa: F401  (the BLAS Numba's np.dot calls: 0.3-0.6 s of every kernel job's rank)
    import torch
    import torch.nn
    import torch.optim  # noqa: F401

    cpu = numba.core.registry.cpu_target
    cpu.target_context.codegen()  # the CPU target: 0.4 s of every Numba rank
    cpu.target_context.refresh()  # its typing and lowering registries: 0.5 s of the first kernel a rank loads
    cpu.typing_context.refresh()
    gc.freeze()  # what is loaded stays out of the workers' collections, which would copy every page they touch


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _keep(connection: socket.socket) -> None:
    """The keeper: fork the worker, relay signals to it and its end to the stand-in; never returns."""
    passed = 3 + len(NAMESPACES)  # streams 0-2, then the namespaces
    header, descriptors, _, _ = connection.recvmsg(_LENGTH.size, socket.CMSG_SPACE(passed * array.array("i").itemsize))
    (size,) = _LENGTH.unpack(header + connection.recv(_LENGTH.size - len(header), socket.MSG_WAITALL))
    message = connection.recv(size, socket.MSG_WAITALL)
    received = array.array("i")
    for _level, _type, data in descriptors:
        received.frombytes(data[: len(data) - len(data) % received.itemsize])
    request = json.loads(message)
    worker = os.fork()
    if worker == 0:
        connection.close()
        _become(request, list(received[:3]), list(received[3:]))
        sys.exit(0)  # the program returned: the interpreter ends as it would have (its exit handlers, MPI's end)
    for descriptor in received:
        os.close(descriptor)
    watch = os.pidfd_open(worker)
    while True:
        ready, _, _ = select.select([connection, watch], [], [])
        if watch in ready:
            _, status = os.waitpid(worker, 0)
            ended = (1, os.WTERMSIG(status)) if os.WIFSIGNALED(status) else (0, os.WEXITSTATUS(status))
            try:
                connection.sendall(_EVENT.pack(*ended))
            finally:
                os._exit(0)
        data = connection.recv(_EVENT.size, socket.MSG_WAITALL)
        if len(data) < _EVENT.size:  # the stand-in is gone (killed by mpirun or a test): so goes the worker
            os.kill(worker, signal.SIGKILL)
            os.waitpid(worker, 0)
            os._exit(0)
        forwarded = _EVENT.unpack(data)[1]
        os.kill(worker, signal.SIGSTOP if forwarded == HOLD else forwarded)


def _become(request: dict, streams: list[int], namespaces: list[int]) -> None:
    """The worker: take the stand-in's streams, namespaces, environment, directory and arguments, and run its
    program."""
    import io

    for signum in range(1, signal.NSIG):
        if signum not in (signal.SIGKILL, signal.SIGSTOP):
            try:
                signal.signal(signum, signal.SIG_DFL)
            except (OSError, ValueError):
                pass
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # (the three a fresh interpreter sets: past a file size limit, a
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write fails with EFBIG instead of the signal ending the process)
    for target, descriptor in enumerate(streams):
        os.dup2(descriptor, target)
        os.close(descriptor)
    _enter(namespaces)
    os.chdir(request["cwd"])  # after the namespaces: joining a mount namespace moves a process to its root
    os.umask(request["umask"])
    os.sched_setaffinity(0, request["cpus"])
    for name, limits in request["limits"].items():
        resource.setrlimit(getattr(resource, name), tuple(limits))
    if _read_at_import(request["env"]) != _read_at_import(os.environ):
        os.execve(sys.executable, [sys.executable, *request["argv"]], request["env"])
    os.environ.clear()
    os.environ.update(request["env"])
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    for number, name in ((1, "stdout"), (2, "stderr")):
        raw = io.FileIO(number, "w", closefd=False)
        binary = raw if unbuffered or number == 2 else io.BufferedWriter(raw)
        stream = io.TextIOWrapper(binary, encoding="utf-8", errors="backslashreplace",
                                  write_through=unbuffered or number == 2, line_buffering=raw.isatty())  # fmt: skip
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    main = types.ModuleType("__main__")
    ended_with: list[int] = []  # the exit status, once the program ended with one
    atexit.register(_end_before_teardown, main, ended_with)  # before the program's: the last exit handler to run
    try:
        _run(request["argv"], main)
    except SystemExit as end:
        if end.code is None or isinstance(end.code, int):
            ended_with.append(end.code or 0)
        raise
    ended_with.append(0)


def _run(arguments: list[str], main: types.ModuleType) -> None:
    """Run ``python ARGUMENTS`` as the interpreter would: in a ``__main__`` module of its own, ``main``, which stays
    until the end, as the interpreter's does (``_end_before_teardown`` frees what it holds)."""
    import runpy

    sys.modules["__main__"] = main
    if arguments[0] == "-m":
        sys.argv = [arguments[1], *arguments[2:]]
        sys.path[0] = os.getcwd()
        runpy._run_module_as_main(arguments[1])  # what the interpreter itself calls for -m
    else:
        sys.argv = list(arguments)
        sys.path[0] = os.path.dirname(os.path.abspath(arguments[0]))
        main.__file__ = arguments[0]
        with open(arguments[0], "rb") as source:
            code = compile(source.read(), arguments[0], "exec")
        exec(code, vars(main))


def _end_before_teardown(main: types.ModuleType, ended_with: list[int]) -> None:
    """A rank whose program returned or called ``sys.exit(N)`` ends, after every other exit handler (mpiscale's,
    h5py's), as the interpreter's end would (MPI finalized, and HDF5 with it), then as the C library's (the
    libraries' destructors), but without the interpreter's teardown of every module: about 0.3 s a rank here,
    spent freeing torch's and Numba's objects, which only the preloading put in ranks that never used them. What
    the program holds is freed first, as that teardown would: its ``__main__``'s names one by one (a file never
    closed is flushed), then its cycles. An uncaught error or a ``sys.exit("message")`` ends as the interpreter
    does."""
    if not ended_with:
        return
    program = vars(main)
    for name in list(program):
        if name != "__builtins__":
            program[name] = None
    gc.collect()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: ignored, as at the interpreter's end
            pass
    MPI = sys.modules.get("mpi4py.MPI")  # mpi4py ends MPI after the teardown, which is left out: so here
    if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()
    ctypes.CDLL(None).exit(ended_with[0])


def _enter(namespaces: list[int]) -> None:
    """Join the stand-in's namespaces where they are not this process's (it is single-threaded, as joining a mount
    namespace requires: a child just forked)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for kind, descriptor in zip(NAMESPACES, namespaces, strict=True):
        theirs, ours = os.fstat(descriptor), os.stat(f"/proc/self/ns/{kind}")
        if (theirs.st_dev, theirs.st_ino) != (ours.st_dev, ours.st_ino) and libc.setns(descriptor, 0) != 0:
            number = ctypes.get_errno()
            raise OSError(number, f"the warm start cannot join its stand-in's {kind} namespace: {os.strerror(number)}")
        os.close(descriptor)


def _read_at_import(environment) -> dict:
    return {name: value for name, value in environment.items() if name.startswith(READ_AT_IMPORT)}


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        stand_in(sys.argv[1], sys.argv[2:])
