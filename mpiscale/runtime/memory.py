"""Keep freed large buffers in the process heap (glibc ``mallopt``).

Every large message arrives in a freshly allocated buffer (it is handed to the
receiving actor, so it cannot be recycled). By default glibc serves such
allocations with ``mmap`` and returns them to the kernel on free, so each
message pays one page fault per 4 KiB - about 1 ms for 16 MiB. Raising the
mmap and trim thresholds lets freed buffers be reused without faults, at the
price of the process keeping its peak heap size, as MPI libraries that cache
registered memory also do. Disable with ``MPISCALE_MALLOC_TUNING=0``.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_TRIM_THRESHOLD = 2**31 - 1  # largest value mallopt's int argument takes


def keep_freed_memory() -> bool:
    """Raise glibc's mmap/trim thresholds; False where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, 1 << 30) == 1
    ok &= mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1
    return bool(ok)
