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
import shutil
import subprocess
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..gpus import SHARE_GPUS, GpuChoice, place_on_gpus
from ..kernels.devices import DEVICES
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
    placed = place_on_gpus(comm, seen) if setting != "cpu" else "cpu"
    refusal = placed if isinstance(placed, str) and setting != "cpu" else None
    if setting == "cuda":
        agree(comm, refusal, "choosing the device", ValueError)
    elif setting == "auto":
        every = comm.allgather((refusal, bool(seen)))
        refused = next((problem for problem, _ in every if problem), None)
        if refused is not None:
            placed = "cpu"
            if comm.Get_rank() == 0 and any(saw for _, saw in every):  # (no note on hosts without GPUs)
                print(f"mpiscale: --device auto runs on the CPU: {refused} (--device cuda would refuse)", flush=True)
    device = "cpu"
    if isinstance(placed, GpuChoice):
        device = f"cuda:{placed.index}"
        _uuids[device] = placed.uuid
        if _torch_sees_gpus():
            import torch

            torch.cuda.set_device(placed.index)
    where = recorded_devices(device, comm)
    if comm.Get_rank() == 0:
        announce("device", where)  # telemetry's record of where the job runs
    return device


def choose_numba_gpu(comm: Comm) -> str:
    """``cuda:K``: this rank's GPU for the Numba kernels under the GPU rule, selected (collective: a refusal on any
    rank, two ranks on one GPU, is raised on every rank)."""
    from ..kernels.devices import gpu_uuids, select_gpu

    placed = place_on_gpus(comm, gpu_uuids())
    agree(comm, f"--device cuda: {placed}" if isinstance(placed, str) else None, "choosing the GPU", ValueError)
    assert isinstance(placed, GpuChoice)
    _uuids[f"cuda:{placed.index}"] = placed.uuid
    return f"cuda:{select_gpu(placed.index)}"


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
