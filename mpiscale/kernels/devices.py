"""Which device runs a family of kernels: ``cpu``, ``cuda``, or ``auto`` (a real GPU when there is one)."""

from __future__ import annotations

DEVICES = ("auto", "cpu", "cuda")


def cuda_usable() -> bool:
    """True when a real CUDA device is present (the simulator does not count)."""
    from numba import config, cuda

    return not config.ENABLE_CUDASIM and cuda.is_available()


def resolve_device(device: str) -> str:
    """``cpu`` or ``cuda``: ``auto`` takes a real CUDA device when one is present."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cpu":
        return "cpu"
    if device == "auto":
        return "cuda" if cuda_usable() else "cpu"
    from numba import cuda

    if not cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but numba finds no CUDA device (see `mpiscale doctor`)")
    return "cuda"


_selected: int | None = None  # the GPU this rank uses, once chosen


def gpu_uuids() -> list[str]:
    """The UUIDs of the GPUs numba shows this process, in its index order (the simulator's are made up)."""
    from numba import cuda

    return [str(getattr(gpu, "uuid", None) or f"GPU-simulated-{gpu.id}") for gpu in cuda.gpus]


def select_gpu(index: int) -> int:
    """Make GPU ``index`` (of those this process sees) the one this rank's kernels run on; returns it. Which index a
    rank takes is the jobs' GPU rule (``mpiscale.gpus``, by the GPUs' identity)."""
    global _selected
    from numba import cuda

    cuda.select_device(index)
    _selected = index
    return index


def gpu_memory_mib() -> float | None:
    """MiB in use on this rank's GPU (all processes'), or None when this rank chose none."""
    if _selected is None:
        return None
    from numba import cuda

    free, total = cuda.current_context().get_memory_info()
    return (total - free) / 2**20
