"""Settings of ``mpiscale memstore``, the store's demo and load job: one dataclass, TOML and the command line."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from ..jobs import option
from ..kernels.devices import DEVICES


@dataclass
class MemstoreConfig:
    """The synthetic workload, the iteration, and where the results go."""

    records: int = option(1_000_000, "records in the store (ids spread over the ranks by hash)")
    iterations: int = option(50, "learning iterations: reinforce, decay, aggregate, rank")
    reinforce: float = option(0.01, "records reinforced per iteration, as a fraction of all (ids drawn with repeats)")
    rate: float = option(0.01, "decay subtracted from every strength per iteration")
    top: int = option(100, "size of the global top-k by quality")
    bins: int = option(32, "histogram bins of the quality over [0, 1)")
    seed: int = option(0, "seed of the workload (the same workload on any number of ranks)")
    out: str = option(
        "memstore.h5",
        "results: per-iteration aggregates and top-k; the records go beside it, NAME.records.h5 for NAME.h5",
    )
    progress_every: float = option(2.0, "seconds between progress lines on rank 0 (0 = only the last)")
    device: str = option(
        "auto", "iterate on cpu, cuda, or auto (a CUDA GPU when present; partitions >= 65,536 records)"
    )
    checkpoint_dir: str = option(
        "", "directory (shared file system) of the store's checkpoints and journal: makes the job durable, and a "
        "rerun after a failure recovers and goes on; empty: not durable",
    )  # fmt: skip
    local_dir: str = option(
        "", "node-local directory for the logs and checkpoint shards (each copied to a rank on the next node); "
        "empty: everything in --checkpoint-dir",
    )  # fmt: skip
    checkpoint_every: int = option(10, "iterations between checkpoints of a durable job (they bound the logs)")
    accept_rollback: bool = option(
        False, "recover even when logs are lost or damaged (or journal.json is gone), from the newest state the "
        "remaining files hold, losing the commits after it (refused without this)",
    )  # fmt: skip

    def __post_init__(self) -> None:
        problems = []
        for name in ("records", "iterations", "top", "bins", "checkpoint_every"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.reinforce <= 1:
            problems.append(f"reinforce must be a fraction in [0, 1], got {self.reinforce}")
        if not 0 <= self.rate <= 1:  # NaN fails too
            problems.append(f"rate must be a number in [0, 1], got {self.rate}")
        if self.device not in DEVICES:
            problems.append(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.local_dir and not self.checkpoint_dir:
            problems.append("--local-dir needs --checkpoint-dir (the shared directory of the checkpoints)")
        if problems:
            raise ValueError("memstore settings: " + "; ".join(problems))

    @property
    def records_path(self) -> str:
        """Where the final records go (a sharded data set: ids and one data set per column)."""
        return str(Path(self.out).with_suffix(".records.h5"))

    def to_dict(self) -> dict:
        return asdict(self)

    def workload(self) -> dict:
        """The settings that make the job's records what they are: a recovered run must share them."""
        return {name: getattr(self, name) for name in ("records", "reinforce", "rate", "top", "bins", "seed")}
