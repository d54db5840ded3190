"""Circuits: similar search against numpy and faiss, and many feature circuits against one at a time.

1. Similar search (exact cosine top-10) over N unit embeddings of 128 numbers
   (1M; 100k with --quick), in memory, at filter selectivities of 1, 10 and
   100%: ours (one float32 product per block of 65,536 rows, of the rows the
   filter passes when it passes fewer than half, and the Numba running
   top-k) against numpy (one product, the filtered-out scores set to -inf,
   ``argpartition`` then a sort of the k) and faiss ``IndexFlatIP`` with an
   ``IDSelectorBitmap`` (its exact index, the strongest peer on a CPU).
   Queries per second, batched (100 queries at once) and single (one at a
   time), every library with the machine's cores; recall@10 of each against
   float64 brute force.
2. Many circuits: K = 100 feature circuits of one model's layer (an MLP of
   64 -> 256 -> 256, saved with TorchScript, and 100 atoms) on 8,192 inputs:
   one circuit at a time (the model up to the layer, then its atom: the
   prototype's way) against ``Selection.features`` (the model once, the atoms
   as one product), through the catalogue.

One process, no mpirun.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from ..circuits.catalogue import Catalogue
from ..circuits.features import select
from ..circuits.similar import Neighbours, nearest
from ..circuits.store import ModelRef, NewCircuits, add_circuits
from ..kernels.threads import share_cores
from ..kernels.topk import empty_top_k
from .report import best_of, table, write_json

K = 10
DIMENSION = 128
BATCH = 100
SINGLES = 20
SELECTIVITIES = (0.01, 0.1, 1.0)


def run_circuits_bench(json_path: str, quick: bool = False) -> dict:
    share_cores(1)  # BLAS (our products and numpy's) on every core; faiss's OpenMP likewise
    torch.set_num_threads(os.cpu_count() or 1)
    rows = 100_000 if quick else 1_000_000
    search = _similar(rows, 1 if quick else 3)
    many = _many_circuits(100, 8192, 1 if quick else 3)
    results = {"similar": search, "many_circuits": many}
    write_json(json_path, "circuits", 1, results)
    return results


def _similar(rows: int, repeats: int) -> list[dict]:
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((rows, DIMENSION), dtype=np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    queries = rng.standard_normal((BATCH, DIMENSION), dtype=np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    ids = np.arange(rows, dtype=np.int64)
    faiss = _faiss()
    index = None
    if faiss is not None:
        index = faiss.IndexFlatIP(DIMENSION)
        index.add(vectors)
    out: list[dict] = []
    for share in SELECTIVITIES:
        allowed = rng.random(rows) < share if share < 1 else np.ones(rows, bool)
        exact = _exact(vectors, allowed, queries[:SINGLES])
        engines: dict[str, Callable[[np.ndarray], np.ndarray]] = {
            "ours": partial(_ours, vectors, ids, allowed),
            "numpy": partial(_numpy, vectors, allowed),
        }
        if index is not None:
            engines["faiss IndexFlatIP"] = partial(_faiss_search, faiss, index, allowed)
        for name, engine in engines.items():
            engine(queries)  # warm: compiled kernels, pages of the vectors

            def singles(e: Callable[[np.ndarray], np.ndarray] = engine) -> None:
                for i in range(SINGLES):
                    e(queries[i : i + 1])

            batched = best_of(partial(engine, queries), repeats)
            single = best_of(singles, repeats) / SINGLES
            found = np.concatenate([engine(queries[i : i + 1]) for i in range(SINGLES)])
            recall = np.mean([len(set(f) & set(e)) / K for f, e in zip(found, exact)])
            out.append({"rows": rows, "selectivity": share, "engine": name, "batched_qps": BATCH / batched,
                        "single_qps": 1 / single, "recall_at_10": float(recall)})  # fmt: skip
    if faiss is None:
        print("faiss is not installed (pip install faiss-cpu, or the bench extra): its rows are left out")
    print(f"similar search: exact top-{K} of {rows:,} x {DIMENSION} unit vectors, {BATCH} queries batched or one "
          f"at a time, {os.cpu_count()} cores")  # fmt: skip
    baseline = {(r["selectivity"], r["engine"]): r for r in out}
    peer = "faiss IndexFlatIP" if faiss is not None else "numpy"
    print(table(["selectivity", "engine", "batched q/s", "single q/s", "recall@10", f"batched vs {peer}"],
                [[f"{r['selectivity']:.0%}", r["engine"], r["batched_qps"], r["single_qps"], r["recall_at_10"],
                  f"{r['batched_qps'] / baseline[(r['selectivity'], peer)]['batched_qps']:.2f}x"]
                 for r in out]))  # fmt: skip
    return out


def _ours(vectors: np.ndarray, ids: np.ndarray, allowed: np.ndarray, queries: np.ndarray) -> np.ndarray:
    found = Neighbours(*empty_top_k(len(queries), K))
    nearest(vectors, ids, allowed, queries, found)
    return found.rows


def _numpy(vectors: np.ndarray, allowed: np.ndarray, queries: np.ndarray) -> np.ndarray:
    scores = queries @ vectors.T
    scores[:, ~allowed] = -np.inf
    top = np.argpartition(-scores, K - 1, axis=1)[:, :K]
    order = np.argsort(-np.take_along_axis(scores, top, 1), axis=1, kind="stable")
    return np.take_along_axis(top, order, 1)


def _faiss():
    try:
        import faiss
    except ImportError:
        return None
    faiss.omp_set_num_threads(os.cpu_count() or 1)
    return faiss


def _faiss_search(faiss, index, allowed: np.ndarray, queries: np.ndarray) -> np.ndarray:
    if allowed.all():
        return index.search(queries, K)[1]
    selector = faiss.IDSelectorBitmap(np.packbits(allowed, bitorder="little"))
    return index.search(queries, K, params=faiss.SearchParameters(sel=selector))[1]


def _exact(vectors, allowed, queries) -> np.ndarray:
    scores = queries.astype(np.float64) @ vectors.T.astype(np.float64)
    scores[:, ~allowed] = -np.inf
    return np.argsort(-scores, axis=1)[:, :K]


def _many_circuits(count: int, inputs: int, repeats: int) -> dict:
    torch.manual_seed(0)
    prefix = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                 torch.nn.ReLU()).eval()  # fmt: skip
    rng = np.random.default_rng(1)
    atoms = rng.standard_normal((count, 256)).astype(np.float32)
    data = rng.standard_normal((inputs, 64)).astype(np.float32)
    with tempfile.TemporaryDirectory() as scratch:
        saved = os.path.join(scratch, "prefix.pt")
        torch.jit.save(torch.jit.script(prefix), saved)
        path = os.path.join(scratch, "catalogue.h5")
        model = ModelRef.of(saved, "torchscript", 64, "float32")
        add_circuits(path, NewCircuits(model, "", [f"f{j}" for j in range(count)], atoms, "bench"))
        with Catalogue(path) as catalogue:
            selection = select(catalogue, [], verify=False)
        module = torch.jit.load(saved)

        def one_at_a_time() -> np.ndarray:
            columns = []
            with torch.no_grad():
                for atom in atoms:
                    columns.append(module(torch.from_numpy(data)).numpy() @ atom)
            return np.stack(columns, axis=1)

        ours = best_of(lambda: selection.features(data), repeats)
        baseline = best_of(one_at_a_time, repeats)
        np.testing.assert_allclose(selection.features(data), one_at_a_time(), rtol=1e-4, atol=1e-4)
    result = {"circuits": count, "inputs": inputs, "one_at_a_time_s": baseline, "ours_s": ours,
              "speedup": baseline / ours}  # fmt: skip
    print(f"many circuits: {count} feature circuits of one layer on {inputs:,} inputs")
    print(table(["engine", "seconds", "inputs x circuits / s", "vs one at a time"],
                [["one circuit at a time", baseline, inputs * count / baseline, "1.00x"],
                 ["ours (prefix once, atoms as one product)", ours, inputs * count / ours,
                  f"{baseline / ours:.1f}x"]]))  # fmt: skip
    return result


def command(args: argparse.Namespace) -> int:
    """``mpiscale bench ...``: the options parsed, the benchmark run, its table printed and its JSON written."""
    run_circuits_bench(args.json, quick=args.quick)
    return 0
