"""One device rule for the torch jobs: ``auto``, ``cpu`` or ``cuda``, and with ``cuda`` one rank per GPU.

Which GPU a rank takes is decided by the GPUs' identity (:mod:`mpiscale.gpus`): the ranks of a host gather the
UUIDs each one sees, so a Slurm job with ``--gpus-per-task=1`` (each rank sees one GPU) is four ranks on four GPUs,
not four ranks on one. Two ranks on one GPU are refused unless the user shares GPUs on purpose
(``MPISCALE_SHARE_GPUS=1``; the tests do, on a machine with one GPU). ``auto`` takes the GPUs when every rank of the
job can have one of its own under that rule, and else runs every rank on the CPU with a one-line note: only ``cuda``
refuses. The UUID of each rank's GPU goes into the results (``recorded_devices``) and telemetry.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..gpus import SHARE_GPUS, GpuChoice, place_on_gpus
from ..kernels.devices import DEVICES
from ..mpi_library import mapped_mpi_libraries
from ..ranks import agree
from .state import announce

if TYPE_CHECKING:
    from mpi4py.MPI import Comm

#: The rule as every torch job's --device option states it, after its ``cpu`` choice.
DEVICE_RULE = (
    f"cuda (one rank per GPU, by the GPUs each rank sees: two ranks on one GPU refused unless {SHARE_GPUS}=1), "
    "or auto (cuda when every rank can have a GPU of its own, else cpu)"
)
_uuids: dict[str, str] = {}  # the chosen device's UUID, for the record


def choose_torch_device(setting: str, comm: Comm, seen: Sequence[str] | None = None) -> str:
    """``cpu`` or ``cuda:K`` for this rank, made torch's current device; ``setting`` is ``auto``, ``cpu`` or
    ``cuda``. Collective: a refusal of ``cuda`` on any rank (a rank that sees no GPU, two ranks on one) is raised on
    every rank, so none goes on alone into the job's next collective; ``auto`` then runs every rank on the CPU, and
    rank 0 says why in one line. ``seen`` stands for the UUIDs of the GPUs torch shows this rank (tests). The choice
    is a ``device`` event of telemetry."""
    if setting not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {setting!r}")
    if seen is None:
        seen = [] if setting == "cpu" else visible_gpus(setting)
    placed = _placed(setting, comm, seen, "torch") if setting != "cpu" else None
    device = "cpu"
    if placed is not None:
        device = f"cuda:{placed.index}"
        _uuids[device] = placed.uuid
        if _torch_sees_gpus():
            import torch

            torch.cuda.set_device(placed.index)
    where = recorded_devices(device, comm)
    if comm.Get_rank() == 0:
        announce("device", where)  # telemetry's record of where the job runs
    return device


def choose_numba_device(setting: str, comm: Comm) -> str:
    """``cpu`` or ``cuda:K``: where this rank's Numba kernels run, its GPU selected (collective, as
    ``choose_torch_device``): ``cuda`` where a rank finds no GPU, or two ranks would share one, is refused on every
    rank; ``auto`` takes the GPUs when every rank can have one of its own, else the CPU on every rank."""
    from ..kernels.devices import gpu_uuids, resolve_device, select_gpu

    if setting == "cpu":
        return "cpu"  # (the same on every rank: nothing to agree)
    problem = None
    try:
        wanted = resolve_device(setting)  # (the simulator is no GPU for auto)
    except ValueError as error:
        wanted, problem = "cpu", error
    agree(comm, problem, "choosing the GPU", ValueError)
    placed = _placed(setting, comm, gpu_uuids() if wanted == "cuda" else [], "numba")
    if placed is None:
        return "cpu"
    _uuids[f"cuda:{placed.index}"] = placed.uuid
    return f"cuda:{select_gpu(placed.index)}"


def _placed(setting: str, comm: Comm, seen: Sequence[str], finder: str) -> GpuChoice | None:
    """This rank's GPU under the rule (``setting`` ``cuda`` or ``auto``), from the UUIDs ``finder`` shows it; None
    for the CPU (collective). ``cuda`` refused on any rank is raised on every rank; ``auto`` is then the CPU on
    every rank, and rank 0 says why in one line (not where no rank sees a GPU at all)."""
    placed = place_on_gpus(comm, seen, finder=finder)
    refusal = placed if isinstance(placed, str) else None
    if setting == "cuda":
        agree(comm, ValueError(f"--device cuda: {refusal}") if refusal else None, "choosing the device", ValueError)
        return placed if isinstance(placed, GpuChoice) else None
    every = comm.allgather((refusal, bool(seen)))
    refused = next((problem for problem, _ in every if problem), None)
    if refused is None:
        return placed if isinstance(placed, GpuChoice) else None
    if comm.Get_rank() == 0 and any(saw for _, saw in every):
        print(f"mpiscale: --device auto runs on the CPU: {refused} (--device cuda would refuse)", flush=True)
    return None


def device_uuid(device: str) -> str | None:
    """The UUID of the GPU the device rule chose as ``device`` (``cuda:K``) on this rank, or None."""
    return _uuids.get(device)


def recorded_devices(device: str, comm: Comm) -> str:
    """What a results file records of where the ranks ran (collective): one device, or each rank's as JSON; a GPU
    with its UUID (``cuda:0 GPU-8f1c...``)."""
    devices = comm.allgather(f"{device} {_uuids[device]}" if device in _uuids else device)
    return devices[0] if len(set(devices)) == 1 else json.dumps(devices)


def visible_gpus(setting: str = "cuda") -> list[str]:
    """The UUIDs of the GPUs torch shows this process (``CUDA_VISIBLE_DEVICES`` applied), in its index order; none
    where ``auto`` finds no GPU driver (torch is not even imported then)."""
    if setting == "auto" and not _gpu_device_files():
        return []
    if not _torch_sees_gpus():
        return []
    import torch

    return [_uuid_text(torch.cuda.get_device_properties(index)) for index in range(torch.cuda.device_count())]


def _uuid_text(properties: object) -> str:
    """A GPU's UUID as nvidia-smi writes it (``GPU-...``; ``MIG-...`` stays as torch gives it)."""
    uuid = str(properties.uuid)  # type: ignore[attr-defined]
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def _torch_sees_gpus() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def _gpu_device_files() -> bool:
    """Whether the kernel shows a GPU driver's device files (NVIDIA's, or ROCm's, which torch drives as cuda)."""
    return bool(glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd") or os.path.exists("/dev/dxg"))


def mpi_cuda_aware() -> bool | None:
    """Whether the MPI library this process loaded takes device buffers now, as it says at run time
    (``MPIX_Query_cuda_support``, Open MPI's and MPICH's extension), or None where it has no such query.

    Run time, not the build: a library built with CUDA can still have it off (``--mca opal_cuda_support 0``), and
    ``ompi_info`` may describe another ``libmpi`` than the one mpi4py loaded. Its UCX may still lack CUDA: only
    ``agreed_cuda_aware``'s self-test tells that.
    """
    import ctypes

    from mpi4py import MPI  # noqa: F401 (loads the library asked)

    for path in mapped_mpi_libraries():
        try:
            query = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support", None)
        except OSError:
            continue
        if query is not None:
            query.restype = ctypes.c_int
            return bool(query())
    return None


def agreed_cuda_aware(
    comm: Comm,
    device: str,
    query: Callable[[], bool | None] = mpi_cuda_aware,
    self_test: Callable[[Comm, str], bool] | None = None,
) -> bool:
    """Whether every rank's MPI takes device buffers (collective): every rank's library says so at run time, and a
    one-element allreduce of device memory gives the right sum on every rank. Else False on every rank: the caller
    stages through host memory. ``query`` and ``self_test`` stand for the library's answer and the trial (tests)."""
    if not all(comm.allgather(device.startswith("cuda") and query() is True)):
        return False
    trial = self_test or _device_allreduce_works
    try:
        works = trial(comm, device)
    except Exception:  # an MPI that refuses the pointer with an error (a segfault cannot be caught: see the guide)
        works = False
    return all(comm.allgather(works))


def _device_allreduce_works(comm: Comm, device: str) -> bool:
    """A one-element allreduce of ``device`` memory: the sum of the ranks' numbers, right on this rank."""
    import torch
    from mpi4py import MPI

    value = torch.full((1,), float(comm.Get_rank() + 1), dtype=torch.float64, device=device)
    torch.cuda.current_stream(value.device).synchronize()
    comm.Allreduce(MPI.IN_PLACE, value, op=MPI.SUM)
    size = comm.Get_size()
    return float(value.item()) == size * (size + 1) / 2
