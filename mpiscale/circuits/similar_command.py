"""``mpiscale circuits similar``: the queries, the search on every rank, the answer printed by rank 0."""

from __future__ import annotations

import argparse
import json

import numpy as np

from ..errors import MpiscaleError
from ..kernels.topk import NO_ID
from ..runtime import ActorSystem, run
from .catalogue import Catalogue
from .filters import Filter, check_filters, parse_filters
from .similar import Neighbours, drop_rows, similar, unit_queries
from .sources import read_matrix


def similar_command(args: argparse.Namespace) -> int:
    """Run the search on every rank (one process, or under the launcher); bad input exits 2 with one message."""
    return run(lambda system: _search(system, args))


async def _search(system: ActorSystem, args: argparse.Namespace) -> int:
    from mpi4py import MPI

    problem: Exception | None = None
    catalogue = None
    try:
        if args.k < 1:
            raise ValueError(f"-k must be at least 1, got {args.k}")
        if bool(args.to) == bool(args.vector):
            raise ValueError("give --to NAME (repeatable) or --vector FILE.npy")
        filters: list[Filter] = parse_filters(args.where)
        catalogue = Catalogue(args.catalogue)
        check_filters(catalogue, filters)
        queries, own, space = _queries(catalogue, args)
    except (MpiscaleError, ValueError, OSError) as error:
        problem = ValueError(f"mpiscale circuits similar: {error}")
    await system.agree(problem, "the catalogue and the queries")
    assert catalogue is not None
    with catalogue:
        wanted = args.k + (1 if args.to else 0)  # a circuit is its own nearest: one more, then it is dropped
        comm = MPI.COMM_WORLD if system.size > 1 else None
        found = similar(catalogue, space, queries, wanted, filters, comm)
        if found is None:
            return 0
        found = drop_rows(found, own, args.k)
        names = catalogue.column("name")
        labels = args.to or [f"vector {q}" for q in range(len(queries))]
        _print(found, labels, names, space.name, catalogue.count)
        if args.json:
            _write(args.json, found, labels, names)
    return 0


def _queries(catalogue: Catalogue, args: argparse.Namespace):
    """(unit query rows, each query's own circuit row or None, the space searched)."""
    if args.to:
        rows = catalogue.find(args.to)
        spaces, places = catalogue.column("space")[rows], catalogue.column("space_row")[rows]
        if len(set(spaces.tolist())) > 1 and not args.space:
            raise ValueError("the --to circuits are in different embedding spaces: give --space NAME")
        space = catalogue.space_named(args.space, None) if args.space else catalogue.spaces[int(spaces[0])]
        for name, where in zip(args.to, spaces):
            if where != space.index:
                raise ValueError(f"circuit {name} is not in space {space.name}")
        vectors = [catalogue.vectors(space.index, int(at), int(at) + 1)[0][0] for at in places]
        return unit_queries(np.array(vectors), "--to"), rows, space
    matrix = read_matrix(args.vector)
    space = catalogue.space_named(args.space, matrix.shape[1])
    return unit_queries(matrix, args.vector), [None] * len(matrix), space


def _print(found: Neighbours, labels: list[str], names: np.ndarray, space: str, total: int) -> None:
    for query, label in enumerate(labels):
        kept = found.rows[query] != NO_ID
        print(f"nearest to {label} in space {space} (cosine), of {total} circuits:")
        for rank, (score, row) in enumerate(zip(found.scores[query][kept], found.rows[query][kept]), 1):
            print(f"  {rank:3d}. {score:+.4f}  {names[row]}")
        if not kept.any():
            print("  (no circuit passes the filters)")


def _write(path: str, found: Neighbours, labels: list[str], names: np.ndarray) -> None:
    document = []
    for query, label in enumerate(labels):
        kept = found.rows[query] != NO_ID
        document.append({"query": label, "neighbours": [
            {"name": str(names[row]), "row": int(row), "cosine": float(score)}
            for score, row in zip(found.scores[query][kept], found.rows[query][kept])
        ]})  # fmt: skip
    with open(path, "w", encoding="utf-8") as stream:
        json.dump(document, stream, indent=1)
    print(f"wrote {path}")
