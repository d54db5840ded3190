"""A package's public names loaded on first use (PEP 562), so importing one of its modules stays cheap.

The command line reads every job's settings module to build its options; a
package whose ``__init__`` imported its kernels eagerly would make every
command pay for numba or torch. A package lists ``name -> module`` instead.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any


def lazy_exports(package: str, public: dict[str, str]) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``package``: a name of ``public`` is imported from its module (relative to the
    package) when first used, and cached in the package's namespace."""

    def __getattr__(name: str) -> Any:
        if name not in public:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(f".{public[name]}", package), name)
        setattr(import_module(package), name, value)  # loaded once; documentation tools see it like any other name
        return value

    return __getattr__
