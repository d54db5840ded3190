"""One device rule for the torch jobs: ``auto``, ``cpu`` or ``cuda``, and with ``cuda`` one rank per GPU.

A rank takes GPU ``(its index among its host's ranks) mod (the GPUs it sees)``. More ranks on a host than GPUs
would put two ranks' models, optimizers and batches on one GPU: that is refused unless the user shares GPUs on
purpose (``MPISCALE_SHARE_GPUS=1``; the tests do, on a machine with one GPU). ``auto`` takes a GPU when torch sees
one, under the same rule. Everything but torch's own view of the GPUs is plain logic (``gpu_for_rank``), tested on
any machine.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
from typing import TYPE_CHECKING

from ..kernels.devices import DEVICES
from ..ranks import agree, host_placement
from .state import announce

if TYPE_CHECKING:
    from mpi4py.MPI import Comm

SHARE_GPUS = "MPISCALE_SHARE_GPUS"
#: The rule as every torch job's --device option states it, after its ``cpu`` choice.
DEVICE_RULE = (
    f"cuda (rank k of a host on GPU k mod its GPUs; more ranks on a host than GPUs refused unless {SHARE_GPUS}=1), "
    "or auto (the GPU rule when torch sees a GPU, else cpu)"
)


def gpu_for_rank(rank_on_host: int, ranks_on_host: int, gpus: int, share: bool = False) -> int:
    """The GPU index of the rank ``rank_on_host`` of ``ranks_on_host`` on a host with ``gpus`` GPUs.

    Refuses (``ValueError``, one line) a host with no GPU, and more ranks than GPUs unless ``share``.
    """
    if gpus < 1:
        raise ValueError("--device cuda: torch sees no CUDA GPU on this host (mpiscale doctor says what it finds)")
    if ranks_on_host > gpus and not share:
        raise ValueError(
            f"--device cuda: {ranks_on_host} ranks on this host and {gpus} GPU{'s' if gpus > 1 else ''}: start one "
            f"rank per GPU, or set {SHARE_GPUS}=1 to share GPUs on purpose"
        )
    return rank_on_host % gpus


def choose_torch_device(setting: str, comm: Comm) -> str:
    """``cpu`` or ``cuda:K`` for this rank, made torch's current device; ``setting`` is ``auto``, ``cpu`` or
    ``cuda``. Collective: a refusal on any rank (a host without a GPU, too many ranks on one) is raised on every
    rank, so none goes on alone into the job's next collective. The choice is a ``device`` event of telemetry."""
    if setting not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {setting!r}")
    rank_on_host, ranks_on_host = host_placement(comm)
    device, problem = "cpu", None
    try:
        device = _device_of_rank(setting, rank_on_host, ranks_on_host)
    except ValueError as error:
        problem = error
    agree(comm, problem, "choosing the device", ValueError)
    where = recorded_devices(device, comm)
    if comm.Get_rank() == 0:
        announce("device", where)  # telemetry's record of where the job runs
    return device


def recorded_devices(device: str, comm: Comm) -> str:
    """What a results file records of where the ranks ran (collective): one device, or each rank's as JSON."""
    devices = comm.allgather(device)
    return devices[0] if len(set(devices)) == 1 else json.dumps(devices)


def _device_of_rank(setting: str, rank_on_host: int, ranks_on_host: int) -> str:
    if setting == "cpu" or (setting == "auto" and not _gpu_device_files()):
        return "cpu"  # auto on a host without GPUs: no need to import torch to learn it
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if setting == "auto" and gpus == 0:
        return "cpu"
    index = gpu_for_rank(rank_on_host, ranks_on_host, gpus, share=os.environ.get(SHARE_GPUS) == "1")
    torch.cuda.set_device(index)
    return f"cuda:{index}"


def _gpu_device_files() -> bool:
    """Whether the kernel shows a GPU driver's device files (NVIDIA's, or ROCm's, which torch drives as cuda)."""
    return bool(glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd") or os.path.exists("/dev/dxg"))


def mpi_cuda_aware() -> bool | None:
    """Whether the MPI library takes device buffers (Open MPI built with CUDA support), or None when it cannot tell.

    Open MPI says so in ``ompi_info``; another MPI library, or none on ``PATH``, is None.
    """
    program = shutil.which("ompi_info")
    if program is None:
        return None
    try:
        listing = subprocess.run(
            [program, "--parsable", "--all"], capture_output=True, text=True, timeout=60, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in listing.splitlines():
        if line.startswith("mca:opal:base:param:opal_built_with_cuda_support:value:"):
            return line.rsplit(":", 1)[1] == "true"
    return None
