"""The partitioned memory store: records hash-partitioned over the ranks, decayed, reinforced, aggregated, ranked."""

from .partition import BASE_COLUMNS, Partition
from .store import Aggregate, MemoryStore

__all__ = ["BASE_COLUMNS", "Aggregate", "MemoryStore", "Partition"]
