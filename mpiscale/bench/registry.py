"""The benchmarks ``mpiscale bench NAME`` runs: one entry each, its help line and how it starts.

A new benchmark adds a module beside this one and one ``Benchmark`` below; the
CLI builds its choices and help from ``BENCHMARKS``. Modules are imported only
when their benchmark runs, so ``mpiscale --help`` stays fast.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from ..runtime import ActorSystem, run


@dataclass(frozen=True)
class Benchmark:
    name: str
    what: str  # the help line: what is measured against which baseline, on how many ranks
    start: Callable[[argparse.Namespace, str], object]  # (parsed options, JSON path)


def _allreduce(args: argparse.Namespace, json_path: str) -> object:
    from .allreduce import run_allreduce_bench

    return run(lambda system: run_allreduce_bench(system, json_path, quick=args.quick))


def _ddp(args: argparse.Namespace, json_path: str) -> object:
    from .ddp import run_ddp_bench

    return run(lambda system: run_ddp_bench(system, json_path, quick=args.quick))


def _pipeline(args: argparse.Namespace, json_path: str) -> object:
    from .pipeline import run_pipeline_bench

    return run(lambda system: run_pipeline_bench(system, json_path, quick=args.quick))


def _memstore(args: argparse.Namespace, json_path: str) -> object:
    from .memstore import run_memstore_bench

    return run(lambda system: run_memstore_bench(system, json_path, quick=args.quick))


def _pingpong(args: argparse.Namespace, json_path: str) -> object:
    from .pingpong import run_pingpong

    return run(lambda system: run_pingpong(system, json_path, quick=args.quick))


def _random(args: argparse.Namespace, json_path: str) -> object:
    from .sample_random import run_sample_random

    samples = args.samples or (200_000 if args.quick else 4_000_000)
    return run(lambda system: run_sample_random(system, json_path, samples, quick=args.quick))


def _checkpoint(args: argparse.Namespace, json_path: str) -> object:
    from .checkpoint import run_checkpoint_bench

    size_mib = args.size_mib or (128 if args.quick else 1024)
    repeats = 1 if args.quick else 5

    async def bench_checkpoint(system: ActorSystem) -> dict | None:
        return run_checkpoint_bench(system.world.comm, json_path, args.dir, size_mib << 20, repeats)

    return run(bench_checkpoint)


def _omp(args: argparse.Namespace, json_path: str) -> object:
    from .omp import run_omp_bench

    return run_omp_bench(json_path, quick=args.quick)


def _dictlearn(args: argparse.Namespace, json_path: str) -> object:
    from .dictlearn import run_dictlearn_bench

    return run(lambda system: run_dictlearn_bench(system, json_path, args.dir, quick=args.quick))


def _adapters(args: argparse.Namespace, json_path: str) -> object:
    from .adapters import run_adapters_bench

    return run_adapters_bench(json_path, args.dir, quick=args.quick)


def _circuits(args: argparse.Namespace, json_path: str) -> object:
    from .circuits import run_circuits_bench

    return run_circuits_bench(json_path, quick=args.quick)


def _batching(args: argparse.Namespace, json_path: str) -> object:
    from .batching import run_batching_bench

    return run_batching_bench(json_path, args.dir, quick=args.quick)


def _graph(args: argparse.Namespace, json_path: str) -> object:
    from .graph import run_graph_bench

    return run(lambda system: run_graph_bench(system, json_path, quick=args.quick))


def _telemetry(args: argparse.Namespace, json_path: str) -> object:
    from .telemetry import run_telemetry_bench

    return run(lambda system: run_telemetry_bench(system, json_path, args.dir, quick=args.quick))


def _reader(args: argparse.Namespace, json_path: str) -> object:
    from .reader import run_reader_bench

    return run(lambda system: run_reader_bench(system, json_path, args.dir, quick=args.quick))


BENCHMARKS: dict[str, Benchmark] = {
    bench.name: bench
    for bench in [
        Benchmark("pingpong", "actor ask/tell vs raw mpi4py (2 ranks)", _pingpong),
        Benchmark(
            "allreduce",
            "the hierarchical allreduce's bus bandwidth vs MPI.Allreduce and torch.distributed gloo (any ranks)",
            _allreduce,
        ),
        Benchmark("ddp", "a training step of mpiscale.train.DataParallel vs torch DDP with gloo (any ranks)", _ddp),
        Benchmark(
            "pipeline",
            "a pipeline training step (1F1B, GPipe) vs one process, the ideal pipeline and "
            "torch.distributed.pipelining on gloo (2+ ranks, one stage each)",
            _pipeline,
        ),
        Benchmark(
            "memstore",
            "memory store: decay vs numpy and a memory copy; full iterations at 1M and 10M records (any ranks)",
            _memstore,
        ),
        Benchmark("random", "per-sample random parameters vs a numpy generator per sample (any ranks)", _random),
        Benchmark(
            "checkpoint",
            "level-1/level-3/background saves and loads vs the disk and torch.save (any ranks)",
            _checkpoint,
        ),
        Benchmark(
            "adapters",
            "compressing N planted LoRA adapters: ours at 1, 2 and 4 ranks vs one process's covariance and eigh, "
            "chunked meta-PCA and scikit-learn PCA (one process, no mpirun; it launches ours)",
            _adapters,
        ),
        Benchmark(
            "circuits",
            "similar search vs numpy and faiss IndexFlatIP at 1/10/100%% filter selectivity; 100 feature circuits "
            "at once vs one at a time (one process, no mpirun)",
            _circuits,
        ),
        Benchmark(
            "graph",
            "a 16-node circuit plan sequential (the floor), as one remote call per node, and compiled over the "
            "ranks: overhead per cross-rank edge (2 ranks)",
            _graph,
        ),
        Benchmark("omp", "Batch-OMP sparse coding vs scikit-learn's orthogonal_mp_gram (one process, no mpirun)", _omp),
        Benchmark(
            "dictlearn",
            "time to reach the errors of scikit-learn MiniBatchDictionaryLearning and SPAMS trainDL, time per "
            "iteration, OMP throughput (any ranks)",
            _dictlearn,
        ),
        Benchmark(
            "reader",
            "read bandwidth vs np.fromfile, and reading's share of dictlearn training, in memory and streamed",
            _reader,
        ),
        Benchmark(
            "batching",
            "ragged samples within a memory budget: sequential, round-robin, memory and adaptive batching vs "
            "PyTorch's DataLoader with 0 and 2 workers, and vs unbounded read-ahead (one process, no mpirun)",
            _batching,
        ),
        Benchmark(
            "telemetry",
            "a dictlearn run with telemetry off, to a file, to mosquitto and to a broker that never answers",
            _telemetry,
        ),
    ]
}
