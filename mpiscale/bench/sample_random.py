"""Per-sample random parameters: vectorized Philox kernel versus a generator per sample.

The baseline, measured in the same run, is the usual per-sample design: a numpy
``Generator(Philox(key=seed, counter=...))`` built for each sample. Under
``mpirun -n N`` every rank generates its share of the samples with one Numba
thread (one rank per core), and the aggregate rate is total / slowest rank.
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np

from ..io import SampleRandom
from ..ranks import rank_rows
from ..runtime import ActorSystem, run
from .report import table, write_json

PARAMETERS = 8  # random parameters per sample (e.g. crop, flip, colour jitter)
BATCH = 65536  # samples per call


def _per_sample_generators(seed: int, epoch: int, ids: np.ndarray) -> float:
    """Samples per second of one numpy Philox generator per sample (the baseline)."""
    start = time.perf_counter()
    for sample in ids:
        generator = np.random.Generator(np.random.Philox(key=seed, counter=[int(sample), epoch, 0, 0]))
        generator.random(PARAMETERS)
    return len(ids) / (time.perf_counter() - start)


async def run_sample_random(system: ActorSystem, json_path: str, samples: int, quick: bool = False) -> dict | None:
    """Rank 0 prints the table and writes JSON; returns the record there."""
    streams = SampleRandom(seed=2024)
    threads = numba.get_num_threads()
    if system.size > 1:
        numba.set_num_threads(1)
    mine = range(*rank_rows(samples, system.size, system.rank))
    streams.uniform(0, mine[:10], PARAMETERS)  # compile outside the timing
    await system.world.barrier()
    start = time.perf_counter()
    for epoch in range(3):  # streamed in batches: constant memory, as a data loader uses it
        for _batch in streams.iter_uniform(epoch, mine, PARAMETERS, chunk=BATCH):
            pass
    elapsed = (time.perf_counter() - start) / 3
    slowest = await system.world.allreduce(np.array([elapsed]), op="max")
    ours_rate = samples / slowest[0]
    baseline_samples = 2000 if quick else 20000
    baseline_rate = _per_sample_generators(2024, 0, np.arange(baseline_samples)) if system.rank == 0 else 0.0
    numba.set_num_threads(threads)
    if system.rank != 0:
        return None
    used_threads = 1 if system.size > 1 else threads
    rows = [
        ["numpy Generator(Philox) per sample, 1 rank", baseline_samples, baseline_rate, 1.0],
        [
            f"mpiscale SampleRandom, {system.size} rank(s) x {used_threads} thread(s)",
            samples,
            ours_rate,
            ours_rate / baseline_rate,
        ],
    ]
    print(f"{PARAMETERS} uniform parameters per sample, batches of {BATCH} samples; {len(mine)} samples on rank 0")
    print(table(["generator", "samples", "samples/s", "vs baseline"], rows))
    results = {
        "baseline": "numpy Generator(Philox(key=seed, counter=[sample, epoch, 0, 0])).random(8) per sample",
        "parameters_per_sample": PARAMETERS,
        "samples": samples,
        "batch": BATCH,
        "threads_per_rank": used_threads,
        "baseline_samples_per_s": baseline_rate,
        "ours_samples_per_s": ours_rate,
        "ratio": ours_rate / baseline_rate,
    }
    write_json(json_path, "sample_random", system.size, results)
    return results


def command(args: argparse.Namespace) -> int:
    """``mpiscale bench ...``: the options parsed, the benchmark run, its table printed and its JSON written."""
    samples = args.samples or (200_000 if args.quick else 4_000_000)
    run(lambda system: run_sample_random(system, args.json, samples, quick=args.quick))
    return 0
