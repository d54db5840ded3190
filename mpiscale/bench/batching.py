"""Batching ragged samples within a memory budget: our four strategies against PyTorch's DataLoader.

In one run, on an HDF5 file written the way users write ragged data (plain
h5py: float32 ``values`` of 64 numbers a row, ``offsets`` of each sample's
start; samples of 20 to 200 rows, 10x apart; 2 GiB, 256 MiB with --quick, eight times the budget: 256 and 32 MiB;
many times the budget), each setting in a fresh process with the page cache
dropped before it (when root), three times over (the median try reported):

- the disk: ``np.fromfile`` of the whole file, the ceiling of any reader;
- ours, shuffled: ``sequential`` and ``round-robin`` (a fixed count B, read
  ahead two mean batches), ``memory`` (padded batches of at most a third of
  the budget, two read ahead: its default), ``adaptive`` (only the budget), and
  ``memory`` with unbounded read-ahead (the throughput bounded prefetch gives
  up, if any);
- PyTorch's DataLoader over a map-style Dataset reading one sample at a time
  with h5py (what a user writes), shuffled, batches of the same B, with 0 and
  2 workers (prefetch_factor 2).

Every batch goes to the same consumer: fixed work per byte of the batch as a
padded tensor (a sleep, as for a GPU: the CPU stays free for reading) plus a
fixed cost per batch. Reported: samples/s, peak memory of the data path
(the process's VmHWM above its resident size before reading, plus the
DataLoader workers' peak private memory) against the budget, padding share,
and the consumer's stall share.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from .report import drop_page_cache, table, write_json

UNIT = 64  # float32 numbers per row of values
SHORTEST, LONGEST = 20, 200
CONSUMER_BYTES_PER_S = 0.5e9  # the consumer's work: padded bytes a second (about this VM's disk)
PER_BATCH_S = 0.0005  # and its fixed cost per batch
SEED = 0
REPEATS = 3  # tries of each setting (the median is reported)


def write_ragged(path: Path, total_bytes: int) -> dict:
    """A user's ragged file: values (float32 rows of UNIT) and offsets (sample starts), in blocks (plain h5py)."""
    import h5py

    rng = np.random.default_rng(SEED)
    row_bytes = UNIT * 4
    mean = (SHORTEST + LONGEST) / 2
    samples = int(total_bytes / (mean * row_bytes))
    lengths = rng.integers(SHORTEST, LONGEST + 1, samples)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    with h5py.File(path, "w") as file:
        values = file.create_dataset("values", shape=(int(lengths.sum()), UNIT), dtype=np.float32)
        block = 1 << 18
        for at in range(0, len(values), block):
            rows = min(block, len(values) - at)
            values[at : at + rows] = rng.standard_normal((rows, UNIT), dtype=np.float32)
        file["offsets"] = starts
    return {"samples": samples, "bytes": int(lengths.sum()) * row_bytes, "mean_sample_bytes": mean * row_bytes}


class _Peak:
    """The process's data memory: VmHWM above the resident size at start, plus children's peak private memory."""

    def __init__(self) -> None:
        self.base = _status_kib("VmRSS")
        self.children = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._done.wait(0.02):
            self.children = max(self.children, sum(_private_kib(pid) for pid in _children()))

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return (_status_kib("VmHWM") - self.base + self.children) * 1024


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _children() -> list[int]:
    pids: list[int] = []
    for task in Path("/proc/self/task").iterdir():
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return pids


def _private_kib(pid: int) -> int:
    try:
        lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    except OSError:
        return 0
    return sum(int(line.split()[1]) for line in lines if line.startswith(("Private_Clean:", "Private_Dirty:")))


class _Consumer:
    """Fixed work per padded byte plus per batch; counts its stalls (time waiting for the next batch)."""

    def __init__(self, rate: float) -> None:
        self.rate, self.samples, self.padded, self.packed, self.stall = rate, 0, 0, 0, 0.0
        self.started = time.perf_counter()
        self._asked = self.started

    def take(self, count: int, longest: int, packed: int) -> None:
        now = time.perf_counter()
        self.stall += now - self._asked
        padded = count * longest * UNIT * 4
        time.sleep(PER_BATCH_S + padded / self.rate)
        self.samples += count
        self.padded += padded
        self.packed += packed
        self._asked = time.perf_counter()

    def result(self) -> dict:
        seconds = time.perf_counter() - self.started
        return {
            "seconds": seconds,
            "samples_per_s": self.samples / seconds,
            "stall_share": self.stall / seconds,
            "padding_share": 1 - self.packed / self.padded if self.padded else 0.0,
        }


def _ours(path: str, setting: dict, consumer: _Consumer) -> dict:
    from ..io.batching import Batching
    from ..io.ragged import Ragged
    from ..io.sample_reader import SampleReader, open_arrays

    options = {k: v for k, v in setting.items() if k in ("strategy", "batch_size", "batch_bytes", "prefetch_bytes",
                                                          "memory_bytes")}  # fmt: skip
    with SampleReader(open_arrays(path, ["values"], {"values": "offsets"}), Batching(**options), shuffle=True,
                      seed=SEED) as reader:  # fmt: skip
        for batch in reader.epoch(0):
            values = batch.data["values"]
            assert isinstance(values, Ragged)
            consumer.take(len(batch.ids), int(values.lengths.max(initial=0)), batch.nbytes)
        return {"limit": reader.limit(reader.plan(0)), "tuned_batch_bytes": reader.stats.batch_bytes}


class _H5Samples:
    """A map-style torch Dataset of one sample per index, read with h5py (the file opened in each worker)."""

    def __init__(self, path: str) -> None:
        import h5py

        self.path = path
        self.file: Any = None
        self.values: Any = None
        self.edges: np.ndarray
        with h5py.File(path, "r") as file:
            self.edges = np.append(file["offsets"][()], len(file["values"]))

    def __len__(self) -> int:
        return len(self.edges) - 1

    def __getitem__(self, index: int):
        import h5py
        import torch

        if self.values is None:
            self.file = h5py.File(self.path, "r")
            self.values = self.file["values"]
        return torch.from_numpy(self.values[self.edges[index] : self.edges[index + 1]])


def _packed(samples: list):
    import torch

    return torch.cat(samples), torch.tensor([len(s) for s in samples])


def _dataloader(path: str, setting: dict, consumer: _Consumer) -> dict:
    import torch

    torch.set_num_threads(1)
    workers = setting["workers"]
    samples: Any = _H5Samples(path)  # map-style: __getitem__ and __len__
    loader: torch.utils.data.DataLoader = torch.utils.data.DataLoader(
        samples, batch_size=setting["batch_size"], shuffle=True, num_workers=workers, collate_fn=_packed,
        generator=torch.Generator().manual_seed(SEED), prefetch_factor=2 if workers else None,
    )  # fmt: skip
    for values, lengths in loader:
        consumer.take(len(lengths), int(lengths.max()), values.numel() * 4)
    return {}


def run_one(path: str, setting: dict) -> dict:
    """One setting in this process (a fresh one): its throughput, stalls, padding and peak memory."""
    import h5py  # noqa: F401  (imported before the baseline, as every reader needs it)

    if setting["kind"] == "dataloader":
        import torch  # noqa: F401
    else:
        from ..io.reader import epoch_order
        from ..io.sample_reader import SampleReader  # noqa: F401

        epoch_order(8, 0, SEED, True)  # the shuffle's compiled kernel loaded: code, not data
    peak = _Peak()
    consumer = _Consumer(setting["rate"])
    extra = (_dataloader if setting["kind"] == "dataloader" else _ours)(path, setting, consumer)
    return consumer.result() | extra | {"peak_bytes": peak.stop()}


def _in_fresh_process(path: Path, setting: dict) -> dict:
    cold = drop_page_cache()
    done = subprocess.run(
        [sys.executable, "-m", "mpiscale.bench.batching", str(path), json.dumps(setting)],
        capture_output=True, text=True, check=False, timeout=900,
    )  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"bench batching: {setting['name']} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1]) | {"cold": cold}


def _median_run(tries: list[dict]) -> dict:
    """The try of median throughput, with every try's throughput beside it."""
    ranked = sorted(tries, key=lambda found: found["samples_per_s"])
    return ranked[len(ranked) // 2] | {"all_samples_per_s": [found["samples_per_s"] for found in tries]}


def _disk(path: Path) -> float:
    drop_page_cache()
    started = time.perf_counter()
    np.fromfile(path, dtype=np.uint8)
    return os.path.getsize(path) / (time.perf_counter() - started)


def run_batching_bench(json_path: str, workdir: str, quick: bool = False) -> dict:
    budget = (32 if quick else 256) << 20
    Path(workdir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=workdir) as folder:
        path = Path(folder) / "ragged.h5"
        data = write_ragged(path, (256 if quick else 2048) << 20)
        disk = _disk(path)
        rate = CONSUMER_BYTES_PER_S
        count = max(1, int(budget / 3 / data["mean_sample_bytes"]))
        settings = [
            {"name": "sequential", "kind": "ours", "strategy": "sequential", "batch_size": count,
             "prefetch_bytes": budget * 2 // 3},
            {"name": "round-robin", "kind": "ours", "strategy": "round-robin", "batch_size": count,
             "prefetch_bytes": budget * 2 // 3},
            {"name": "memory", "kind": "ours", "strategy": "memory", "batch_bytes": budget // 3},
            {"name": "adaptive", "kind": "ours", "strategy": "adaptive", "memory_bytes": budget},
            {"name": "memory, unbounded read-ahead", "kind": "ours", "strategy": "memory",
             "batch_bytes": budget // 3, "prefetch_bytes": data["bytes"]},
            {"name": "DataLoader, 0 workers", "kind": "dataloader", "workers": 0, "batch_size": count},
            {"name": "DataLoader, 2 workers", "kind": "dataloader", "workers": 2, "batch_size": count},
        ]  # fmt: skip
        tries: dict[str, list[dict]] = {setting["name"]: [] for setting in settings}
        for _ in range(1 if quick else REPEATS):  # interleaved, so a slow spell of the disk hits all alike
            for setting in settings:
                tries[setting["name"]].append(_in_fresh_process(path, setting | {"rate": rate}))
                print(f"  {setting['name']}: {tries[setting['name']][-1]['samples_per_s']:,.0f} samples/s", flush=True)
        runs = {name: _median_run(found) for name, found in tries.items()}
    return _report(json_path, data, budget, disk, rate, count, runs)


def _report(json_path: str, data: dict, budget: int, disk: float, rate: float, count: int, runs: dict) -> dict:
    cold = all(run["cold"] for run in runs.values())
    print(
        f"{data['samples']:,} samples of {SHORTEST}-{LONGEST} rows x {UNIT} float32 ({data['bytes'] / 2**20:.0f} MiB, "
        f"plain h5py values + offsets); budget {budget >> 20} MiB; B = {count} samples; consumer "
        f"{rate / 1e9:.2f} GB/s of padded bytes + {PER_BATCH_S * 1e3:g} ms a batch; disk {disk / 1e9:.2f} GB/s; "
        f"page cache {'dropped before each' if cold else 'NOT dropped (not root): reads come from memory'}"
    )
    unbounded = runs["memory, unbounded read-ahead"]["samples_per_s"]
    rows = [
        [name, run["samples_per_s"], run["samples_per_s"] / unbounded, run["peak_bytes"] / 2**20,
         run["peak_bytes"] / budget, f"{run['padding_share']:.1%}", f"{run['stall_share']:.1%}"]
        for name, run in runs.items()
    ]  # fmt: skip
    headers = ["setting", "samples/s", "vs unbounded", "peak MiB", "peak / budget", "padding", "stalls"]
    print(table(headers, rows))
    fixed = max(runs[name]["samples_per_s"] for name in ("sequential", "round-robin", "memory"))
    loaders = max(runs[name]["samples_per_s"] for name in ("DataLoader, 0 workers", "DataLoader, 2 workers"))
    targets = {
        "memory_peak_vs_budget": runs["memory"]["peak_bytes"] / budget,
        "adaptive_peak_vs_budget": runs["adaptive"]["peak_bytes"] / budget,
        "memory_vs_unbounded": runs["memory"]["samples_per_s"] / unbounded,
        "adaptive_vs_best_fixed": runs["adaptive"]["samples_per_s"] / fixed,
        "memory_vs_best_dataloader": runs["memory"]["samples_per_s"] / loaders,
    }
    print("\n" + table(["target", "ratio"], [[name, value] for name, value in targets.items()]))
    results = {
        "data": data, "budget_bytes": budget, "batch_size": count, "consumer_bytes_per_s": rate,
        "consumer_per_batch_s": PER_BATCH_S, "page_cache_dropped": cold,
        "baseline": {"what": "np.fromfile of the whole file, one process (the disk)", "bytes_per_s": disk},
        "runs": runs, "targets": targets,
    }  # fmt: skip
    write_json(json_path, "batching", 1, results)
    return results


if __name__ == "__main__":
    print(json.dumps(run_one(sys.argv[1], json.loads(sys.argv[2]))))


def command(args: argparse.Namespace) -> int:
    """``mpiscale bench ...``: the options parsed, the benchmark run, its table printed and its JSON written."""
    run_batching_bench(args.json, args.dir, quick=args.quick)
    return 0
