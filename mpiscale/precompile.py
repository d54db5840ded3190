"""Compile the CPU kernels once, in one process, into Numba's cache: ``python -m mpiscale.precompile``.

``launch/setup.sh`` runs it, so a first job on a fresh install (or on a shared
file system) starts warm, and no two ranks race to compile the same kernel and
write the same cache files. It runs small jobs of every kernel family through
the same calls the jobs make (the same argument types, so the same compiled
versions): dictionary learning with both coders and both methods, the memory
store's iteration, 16-bit sums, per-sample random numbers and the similar
search's top-k. A kernel whose source changed is compiled again on its next run
anyway; this only moves that time out of the jobs.
"""

from __future__ import annotations

import io
import tempfile
import time
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np

from .io import SampleRandom
from .jobs import JOBS
from .kernels.halves import SumOfBits, from_bits, to_bits
from .kernels.topk import empty_top_k, merge_top_k
from .runtime import ActorSystem, run


async def _jobs(system: ActorSystem, folder: Path) -> None:
    """Small runs of the jobs whose kernels are Numba's, through their registry entries (as the command line)."""
    dictlearn, memstore = JOBS["dictlearn"], JOBS["memstore"]
    for index, (method, coder) in enumerate([("online", "omp"), ("mod", "omp"), ("online", "lasso")]):
        config = dictlearn.load("settings")(atoms=8, features=6, samples=200, sparsity=2, iterations=3,
                                            batch_size=32, method=method, coder=coder, eval_every=3,
                                            progress_every=0, out=str(folder / f"dictlearn-{index}.h5"))  # fmt: skip
        await dictlearn.load("entry")(system, config)
    config = memstore.load("settings")(records=5000, iterations=3, progress_every=0, out=str(folder / "store.h5"))
    await memstore.load("entry")(system, config)


def _functions() -> None:
    for kind in ("float16", "bfloat16"):
        bits = to_bits(np.linspace(-1, 1, 64, dtype=np.float32), kind)
        from_bits(bits, kind)
        SumOfBits(kind)(np.stack([bits, bits]))
    SampleRandom(0).uniform(0, np.arange(8), 3)
    SampleRandom(0).normal(0, np.arange(8), 3)
    vectors = np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    best, best_ids = empty_top_k(2, 3)
    merge_top_k(vectors[:2] @ vectors.T, vectors[:2], vectors, np.arange(16), np.ones(16, bool), best, best_ids)


def main() -> None:
    began = time.perf_counter()
    _functions()
    with tempfile.TemporaryDirectory(prefix="mpiscale-precompile-") as folder, redirect_stdout(io.StringIO()):
        run(lambda system: _jobs(system, Path(folder)))  # the jobs' own lines are not the setup's
    print(f"[setup] Numba kernels compiled and cached in {time.perf_counter() - began:.0f} s", flush=True)


if __name__ == "__main__":
    main()
