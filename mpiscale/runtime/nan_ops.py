"""MPI's min and max of floating-point arrays as numpy's ``minimum`` and ``maximum``: a NaN anywhere gives NaN.

Open MPI's own MPI_MIN and MPI_MAX compare with ``<`` and ``>``, so a NaN is kept or dropped by the order in which
the ranks' values meet. On 4 ranks of one host, a max over arrays one rank of which held NaN in every other element
came back with no NaN at 4 elements and with a quarter of them at 32 KiB, where 2 ranks (the exchange reduces with
numpy) kept them all: the answer hung on the rank count. The operations made here apply numpy's ufunc to MPI's
buffers, so every path keeps a NaN, as numpy does.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

_UFUNCS = {"min": np.minimum, "max": np.maximum}
_MADE: dict[str, Any] = {}  # by name: made once a process, as MPI keeps its operations until it ends
_DTYPES: dict[int, np.dtype] = {}  # numpy's dtype of each MPI type met, by its handle


def nan_keeping(MPI: ModuleType, name: str) -> Any:
    """The MPI operation ``name`` ("min" or "max") that keeps NaNs, for floating-point arrays."""
    op = _MADE.get(name)
    if op is None:
        ufunc = _UFUNCS[name]

        def reduce(incoming: Any, inout: Any, datatype: Any) -> None:
            dtype = _DTYPES.get(datatype.py2f())
            if dtype is None:
                from mpi4py.util.dtlib import to_numpy_dtype

                dtype = _DTYPES[datatype.py2f()] = to_numpy_dtype(datatype)
            into = np.frombuffer(inout, dtype)
            ufunc(np.frombuffer(incoming, dtype), into, out=into)

        op = _MADE[name] = MPI.Op.Create(reduce, commute=True)
    return op
