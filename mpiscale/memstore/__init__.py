"""The partitioned memory store: records hash-partitioned over the ranks, decayed, reinforced, aggregated, ranked.

Names are loaded on first use: the command line reads the settings without importing the numba kernels.
"""

from ..lazy_exports import lazy_exports

# name -> the module of this package that defines it
_PUBLIC = {
    "BASE_COLUMNS": "partition",
    "Partition": "partition",
    "Durability": "durability",
    "QueryActor": "queries",
    "StoreClient": "queries",
    "serve_queries": "queries",
    "Recovered": "recovery",
    "Aggregate": "store",
    "MemoryStore": "store",
    "best_by_quality": "store",
}

__all__ = sorted(_PUBLIC)
__getattr__ = lazy_exports(__name__, _PUBLIC)
