"""``mpiscale bench adapters``: compressing N planted LoRA adapters, ours against the single-process ways.

One process (no mpirun): for each setting (dimension d, adapters N) it writes
N planted adapters of rank 16 (one layer group, a known 16-dimensional shared
subspace plus noise), then runs every method in a process of its own, so that
each one's wall time and peak resident memory (the largest process's, i.e.
per rank) are its own, from the command's start to its answer (the
interpreter's start, and for ours the launcher's and MPI's, included):

- ``covariance``: the reference implementation's way, every adapter stacked in
  one process, the d x d covariance and ``eigh`` (the exact answer);
- ``meta-pca``: its way for many adapters, a PCA per chunk of 10 adapters and
  a PCA of the chunks' components;
- scikit-learn ``PCA`` with the ``full`` and the ``randomized`` solver;
- ours, ``mpiscale compress-adapters`` at 1, 2 and 4 ranks (exact, ``--device
  cpu``), and the randomized range finder at 2 ranks, launched with
  ``launch/mpiscale-run``; where torch sees a GPU, ours with ``--device cuda`` on
  one rank, in float64 and in float32 refined (``ours-gpu``, ``ours-gpu32``).

Every method keeps 16 components per side. The table gives the seconds, the
peak memory, the share of the sum of squares the components capture against
the exact ones (the same measure for all: rows projected on the components),
and the cosine of the largest angle to the planted subspace.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from .report import table, write_json

RANK, SHARED, NOISE, CHUNK = 16, 16, 0.05, 10
MODULE = "base_model.model.model.layers.0.self_attn.q_proj"
FULL = [(1024, 10), (1024, 100), (1024, 1000), (2048, 200), (4096, 10), (4096, 100)]
QUICK = [(256, 10), (256, 100)]
BASELINES = ("covariance", "meta-pca", "sklearn-full", "sklearn-randomized")


def run_adapters_bench(
    json_path: str, workdir: str, quick: bool = False, sizes: list[tuple[int, int]] | None = None
) -> dict:
    """Every setting (``sizes``: (d, N) pairs to choose) and method; prints the table and writes the JSON record."""
    import h5py
    import torch

    results = []
    gpu = [("ours-gpu", 1), ("ours-gpu32", 1)] if torch.cuda.is_available() else []
    several = h5py.get_config().mpi  # an h5py without MPI runs one-rank jobs only (a GPU image's, say)
    for dimension, count in sizes or (QUICK if quick else FULL):
        root = Path(workdir) / f"adapters-d{dimension}-n{count}"
        bases = _planted(root, dimension, count)
        rows = _stacked(root / "adapters", count)
        exact: dict[str, float] | None = None
        for method, ranks in [*((name, 1) for name in BASELINES), ("ours", 1), ("ours", 2), ("ours", 4),
                              ("ours-randomized", 2), *gpu]:  # fmt: skip
            if method == "sklearn-full" and count * RANK * dimension > 100 * 16 * 1024:
                continue  # minutes of SVD for nothing new: the full solver's answer is the exact one
            if ranks > 1 and not several:
                continue
            measured = _measure(method, ranks, root)
            captured = {side: _captured(rows[side], measured["components"][side]) for side in "AB"}
            exact = exact or captured  # the covariance method runs first: the exact answer
            results.append({
                "d": dimension, "adapters": count, "method": method, "ranks": ranks,
                "seconds": measured["seconds"], "peak_rss_mib": measured["peak_rss_mib"],
                "captured_vs_exact": min(captured[s] / exact[s] for s in "AB"),
                "planted_cosine": min(_cosine(bases[s], measured["components"][s]) for s in "AB"),
            })  # fmt: skip
            print(f"  d {dimension} N {count} {method} ({ranks} ranks): {measured['seconds']:.2f} s", flush=True)
        shutil.rmtree(root, ignore_errors=True)
    for row in results:
        reference = next(r for r in results if r["d"] == row["d"] and r["adapters"] == row["adapters"]
                         and r["method"] == "covariance")  # fmt: skip
        row["speedup_vs_covariance"] = reference["seconds"] / row["seconds"]
    headers = ["d", "adapters", "method", "ranks", "seconds", "x covariance", "peak MiB", "captured/exact",
               "cos planted"]  # fmt: skip
    print(table(headers, [[r["d"], r["adapters"], r["method"], r["ranks"], r["seconds"], r["speedup_vs_covariance"],
                           r["peak_rss_mib"], f"{r['captured_vs_exact']:.6f}", f"{r['planted_cosine']:.5f}"]
                          for r in results]))  # fmt: skip
    write_json(json_path, "adapters", 1, {"rank": RANK, "components": SHARED, "noise": NOISE, "rows": results})
    return {"rows": results}


def _planted(root: Path, dimension: int, count: int) -> dict[str, np.ndarray]:
    from ..adapters.planted import write_planted

    shutil.rmtree(root, ignore_errors=True)
    bases = write_planted(root / "adapters", count, RANK, dimension, dimension, SHARED, NOISE, seed=dimension + count,
                          modules=(MODULE,))  # fmt: skip
    return {"A": bases[MODULE][0], "B": bases[MODULE][1]}


def _stacked(directory: Path, count: int) -> dict[str, np.ndarray]:
    """Every adapter's A rows and B columns, stacked (to score the components, outside any timing)."""
    from ..adapters import open_adapter

    pairs = [open_adapter(str(directory / f"task-{i}")) for i in range(count)]
    read = [adapter.read(adapter.modules[0]) for adapter in pairs]
    return {"A": np.concatenate([a for a, _ in read]), "B": np.concatenate([b.T for _, b in read])}


def _captured(rows: np.ndarray, components: np.ndarray) -> float:
    """The share of the rows' sum of squares their projection on the (orthonormalised) components keeps."""
    basis = np.linalg.qr(components.T)[0]
    return float(np.linalg.norm(rows @ basis) ** 2 / np.linalg.norm(rows) ** 2)


def _cosine(planted: np.ndarray, components: np.ndarray) -> float:
    """Cosine of the largest principal angle between the planted subspace and the components' span."""
    basis = np.linalg.qr(components.T)[0]
    return float(np.linalg.svd(planted @ basis, compute_uv=False).min())


def _measure(method: str, ranks: int, root: Path) -> dict:
    """Run one method in a process of its own: its seconds, peak memory and components."""
    report = root / f"{method}-{ranks}.json"
    command = [sys.executable, "-m", "mpiscale.bench.adapters", method, str(ranks), str(root), str(report)]
    began = time.perf_counter()
    subprocess.run(command, check=True)
    measured = json.loads(report.read_text()) | {"seconds": time.perf_counter() - began}
    measured["components"] = {side: np.load(root / f"{method}-{ranks}-{side}.npy") for side in "AB"}
    return measured


def _worker(method: str, ranks: int, root: Path, report: Path) -> None:
    """In the measured process: run ``method``, save its components, report the largest peak memory."""
    if method.startswith("ours"):
        components = _ours(method, ranks, root)
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # the largest rank (or mpirun)
    else:
        components = _baseline(method, root / "adapters")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for side, vectors in components.items():
        np.save(root / f"{method}-{ranks}-{side}.npy", vectors)
    report.write_text(json.dumps({"peak_rss_mib": peak / 1024}))


def _ours(method: str, ranks: int, root: Path) -> dict[str, np.ndarray]:
    import h5py

    out = root / f"{method}-{ranks}.h5"
    launcher = Path(__file__).resolve().parents[2] / "launch" / "mpiscale-run"
    start = [str(launcher), "-n", str(ranks), "--"] if launcher.is_file() else ["mpirun", "-n", str(ranks)]
    device = "cuda" if method.startswith("ours-gpu") else "cpu"
    settings = ["--components", str(SHARED), "--progress-every", "0", "--device", device]
    if method == "ours-randomized":
        settings += ["--method", "randomized"]
    if method == "ours-gpu32":
        settings += ["--precision", "float32"]
    command = [*start, sys.executable, "-m", "mpiscale.cli", "compress-adapters", "--adapters", str(root / "adapters"),
               *settings, "--out", str(out)]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=os.environ | {"MPISCALE_TELEMETRY": "0"})
    with h5py.File(out, "r") as file:
        return {side: file[f"groups/0000/{side}/components"][()].astype(np.float64) for side in "AB"}


def _baseline(method: str, directory: Path) -> dict[str, np.ndarray]:
    """The single-process ways, on every adapter read and stacked in this process (as the reference does)."""
    from ..adapters import find_adapters, open_adapter

    adapters = [open_adapter(path) for path in find_adapters(str(directory))]
    read = [adapter.read(adapter.modules[0]) for adapter in adapters]
    sides = {"A": [a for a, _ in read], "B": [b.T for _, b in read]}
    found = {}
    for side, blocks in sides.items():
        if method == "covariance":
            stacked = np.concatenate(blocks)
            values, vectors = np.linalg.eigh(stacked.T @ stacked)
            found[side] = vectors[:, np.argsort(values)[::-1][:SHARED]].T
        elif method == "meta-pca":
            chunks = [np.concatenate(blocks[i : i + CHUNK]) for i in range(0, len(blocks), CHUNK)]
            tops = []
            for chunk in chunks:
                _, scales, right = np.linalg.svd(chunk, full_matrices=False)
                tops.append(scales[:SHARED, None] * right[:SHARED])
            found[side] = np.linalg.svd(np.concatenate(tops), full_matrices=False)[2][:SHARED]
        else:
            from sklearn.decomposition import PCA

            solver = "full" if method == "sklearn-full" else "randomized"
            found[side] = PCA(SHARED, svd_solver=solver, random_state=0).fit(np.concatenate(blocks)).components_
    return found


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))


def command(args: argparse.Namespace) -> int:
    """``mpiscale bench ...``: the options parsed, the benchmark run, its table printed and its JSON written."""
    try:
        pairs = (size.split("x") for size in args.sizes.split(",")) if args.sizes else ()
        sizes = [(int(d), int(n)) for d, n in pairs] or None
    except ValueError:
        wrong = f"mpiscale bench adapters: --sizes takes DxN,... (such as 4096x100), got {args.sizes!r}"
        raise SystemExit(wrong) from None
    run_adapters_bench(args.json, args.dir, quick=args.quick, sizes=sizes)
    return 0
