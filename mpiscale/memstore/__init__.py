"""The partitioned memory store: records hash-partitioned over the ranks, decayed, reinforced, aggregated, ranked."""

from .partition import BASE_COLUMNS, Partition
from .queries import QueryActor, StoreClient, serve_queries
from .store import Aggregate, MemoryStore, best_by_quality

__all__ = [
    "BASE_COLUMNS",
    "Aggregate",
    "MemoryStore",
    "Partition",
    "QueryActor",
    "StoreClient",
    "best_by_quality",
    "serve_queries",
]
