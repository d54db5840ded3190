"""The partitioned memory store: records hash-partitioned over the ranks, decayed, reinforced, aggregated, ranked."""

from .durability import Durability
from .partition import BASE_COLUMNS, Partition
from .queries import QueryActor, StoreClient, serve_queries
from .recovery import Recovered
from .store import Aggregate, MemoryStore, best_by_quality

__all__ = [
    "BASE_COLUMNS",
    "Aggregate",
    "Durability",
    "MemoryStore",
    "Partition",
    "QueryActor",
    "Recovered",
    "StoreClient",
    "best_by_quality",
    "serve_queries",
]
