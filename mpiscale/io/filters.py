"""The HDF5 filters a data set's chunks were written with, checked before any read: users compress with filters
their HDF5 build lacks (Blosc, Zstd, LZ4, bitshuffle from hdf5plugin), which HDF5 reports only at the first read,
as a plugin directory it cannot open. A missing filter is loaded from hdf5plugin when it is installed."""

from __future__ import annotations

import h5py

_PLUGINS = "hdf5plugin"  # the package of compression filters h5py users install (registers them on import)


def undecodable(dataset: h5py.Dataset) -> str | None:
    """Why ``dataset``'s chunks cannot be read here (a filter no HDF5 plugin decodes), or None."""
    create = dataset.id.get_create_plist()
    used = [create.get_filter(index) for index in range(create.get_nfilters())]  # (code, flags, values, name)
    missing = [(code, name) for index, (code, flags, _, name) in enumerate(used)
               if not h5py.h5z.filter_avail(code) and _applied(dataset, index, flags)]  # fmt: skip
    if not missing:
        return None
    installed = _load_plugins()
    missing = [(code, name) for code, name in missing if not h5py.h5z.filter_avail(code)]
    if not missing:
        return None
    code, name = missing[0]
    which = f"HDF5 filter {code}" + (f" ({name.decode(errors='replace')})" if name else "")
    if not installed:
        fix = f"pip install {_PLUGINS} (read with it when installed), or set HDF5_PLUGIN_PATH to the filter's plugins"
        return f"is compressed with {which}, which this HDF5 cannot decode: {fix}"
    return (f"is compressed with {which}, which neither this HDF5 nor {_PLUGINS} decodes: set HDF5_PLUGIN_PATH to "
            "the directory of the filter's plugin, or rewrite the data without it (h5repack -f NONE)")  # fmt: skip


def _load_plugins() -> bool:
    """Register hdf5plugin's filters with HDF5 (its import does); False when it is not installed."""
    try:
        __import__(_PLUGINS)
    except ImportError:
        return False
    return True


def _applied(dataset: h5py.Dataset, index: int, flags: int) -> bool:
    """Whether filter ``index`` was applied to the chunks: always for a mandatory one; an optional one (h5py makes
    every filter optional) may have been skipped where it failed at writing, which the first chunk's mask says."""
    if not flags & h5py.h5z.FLAG_OPTIONAL:
        return True
    if not dataset.id.get_num_chunks():
        return False  # (no chunk stored: refused as never written)
    return not dataset.id.get_chunk_info(0).filter_mask & (1 << index)
