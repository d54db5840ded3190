"""Queries while iterations run: one query actor per rank answers for its partition, a client asks the owners.

``group = await serve_queries(store)`` (collective) spawns the actors;
``StoreClient(store, group)`` then works from any actor or task on any rank:
``get(ids)`` asks only the ranks that own the ids (concurrently) and puts the
answers back in the order asked; ``top(k)`` asks every rank for its best k and
merges them with the store's ranking (quality descending, ties by id). A query
sees a partition between two of the store's steps, never in the middle of one:
the actor runs on the rank's event loop, and the store's kernels do not await.
"""

from __future__ import annotations

import asyncio

import numpy as np

from ..kernels.memstore import owners
from ..runtime import Actor, ActorGroup
from .store import MemoryStore, best_by_quality

QUERY_ACTOR = "memstore-queries"


class QueryActor(Actor):
    """Answers for this rank's partition of ``store``."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store

    def get(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(found, one row of every column per id) for ids this rank owns."""
        return self.store.partition.read(np.ascontiguousarray(ids, np.int64))

    def top(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """This rank's best ``k`` (qualities, ids)."""
        partition = self.store.partition
        return best_by_quality(partition.column("quality"), partition.ids, k)


async def serve_queries(store: MemoryStore, name: str = QUERY_ACTOR) -> ActorGroup:
    """Spawn the query actor of every rank (collective); ``name`` tells apart the actors of several stores."""
    return await store.system.spawn_group(QueryActor, store, name=name)


class StoreClient:
    """Reads of a running store, from anywhere in the job."""

    def __init__(self, store: MemoryStore, group: ActorGroup, timeout: float | None = 30.0) -> None:
        self.group, self.timeout, self.columns = group, timeout, len(store.columns)

    async def get(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(found, values) for ``ids``, in the order given."""
        ids = np.ascontiguousarray(ids, np.int64)
        owner = owners(ids, len(self.group))
        if len(ids) == 1 or (len(ids) and (owner == owner[0]).all()):  # one owner: its answer is in order
            return await self.group[int(owner[0])].ask("get", ids, timeout=self.timeout)
        ranks = np.unique(owner)
        asked = [np.flatnonzero(owner == rank) for rank in ranks]
        requests = [self.group[int(r)].ask("get", ids[where], timeout=self.timeout) for r, where in zip(ranks, asked)]
        answers = await asyncio.gather(*requests)
        found = np.zeros(len(ids), bool)
        values = np.full((len(ids), self.columns), np.nan, np.float32)
        for where, (part_found, part_values) in zip(asked, answers):
            found[where], values[where] = part_found, part_values
        return found, values

    async def top(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The job-wide best ``k`` (qualities, ids)."""
        answers = await self.group.ask_all("top", k, timeout=self.timeout)
        quality = np.concatenate([q for q, _ in answers])
        ids = np.concatenate([i for _, i in answers])
        return best_by_quality(quality, ids, k)
