"""Settings of a dictionary-learning job: one dataclass, loaded from TOML, overridden from the command line.

Every field has a default that runs on a laptop (the K-SVD synthetic setting)
and a help text that ``mpiscale dictlearn --help`` shows.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from ..io import split_spec
from ..jobs import (
    DEVICES,
    checkpoint_level_problems,
    load_settings,
    local_dir_option,
    mark_every_option,
    mark_every_problems,
    option,
    shared_every_option,
)

METHODS = ("online", "mod")
CODERS = ("omp", "lasso")
IN_MEMORY = ("auto", "yes", "no")
#: The noisiest synthetic set (noise of 10**10 times the signal's power): below it, no planted atom can be found.
LOWEST_SNR_DB = -100.0


def coder_problems(coder: str, alpha: float, max_residual: float, device: str) -> list[str]:
    """What is wrong with a coder's settings (the same for learning and for ``encode``); a device no job takes was
    said only when the GPU was chosen ("choosing the GPU failed: rank 0: ValueError: ...")."""
    problems = []
    if device not in DEVICES:
        problems.append(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if coder not in CODERS:
        problems.append(f"coder must be one of {', '.join(CODERS)}, got {coder!r}")
    if not (alpha > 0 and math.isfinite(alpha)):
        problems.append(f"alpha must be a positive number, got {alpha}")
    if not (max_residual >= 0 and math.isfinite(max_residual)):
        problems.append(f"max_residual must be a number >= 0, got {max_residual}")
    elif max_residual and coder != "omp":
        problems.append("max_residual is an error target of the omp coder; the lasso coder takes alpha")
    elif max_residual and device == "cuda":
        problems.append("OMP to an error target (max_residual) runs on the CPU: give --device cpu or auto")
    return problems


@dataclass
class DictLearnConfig:
    """What to learn from, how, and where the results go."""

    data: str = option(
        "",
        "signals, one per row: FILE.h5:/path/to/dataset (any HDF5 file; the dataset may be omitted when it is "
        "the file's only one), a quoted glob 'run-*.h5:/X', a list FILES.txt:/X (one path a line), FILE.npy, or "
        "FILE.npz:/NAME; empty = generate the planted synthetic set",
    )
    atoms: int = option(50, "dictionary size K")
    sparsity: int = option(3, "OMP: non-zeros per code L (the synthetic data use as many)")
    batch_size: int = option(256, "online: global mini-batch size B (split over the ranks)")
    iterations: int = option(400, "online: mini-batches; mod: passes over the whole data set")
    method: str = option("online", "online (Mairal et al. 2009, mini-batches) or mod (batch, whole data set)")
    coder: str = option("omp", "sparse coder: omp (Batch-OMP, L non-zeros) or lasso (L1 penalty alpha)")
    alpha: float = option(0.1, "lasso: L1 penalty of the codes")
    max_residual: float = option(
        0.0,
        "omp: code each signal only until its residual norm ||x - cD|| is at most this, with at most SPARSITY atoms "
        "(0 = always SPARSITY atoms; SPAMS's eps; for denoising about 1.15 sigma sqrt(features))",
    )
    remove_mean: bool = option(
        False, "subtract each signal's mean before coding and learning (image patches: atoms of texture, not light)"
    )
    device: str = option("auto", "OMP on cpu, cuda, or auto (a CUDA GPU when present)")
    seed: int = option(0, "seed of the initial dictionary, the batch order and the synthetic data")
    forgetting: float = option(10.0, "online: past statistics weigh (1 - 1/t)^FORGETTING at iteration t")
    replace_after: int = option(3, "replace an atom unused in this many consecutive batches")
    max_replace: int = option(4, "most atoms replaced per iteration (by the worst-coded signals of the batch)")
    duplicate_cosine: float = option(0.99, "replace one of two atoms whose |cosine| exceeds this (1 = never)")
    in_memory: str = option(
        "auto", "keep the signals in memory: yes, no (stream them), or auto (when they fit in half the free memory)"
    )
    shuffle_window_mib: float = option(
        64.0, "online: data larger than this many MiB of float64 rows are shuffled in windows of this size"
    )
    out: str = option("results.h5", "results file (written at the end, atomically)")
    checkpoint_every: int = option(0, "checkpoint every N iterations (0 = never)")
    checkpoint_dir: str = option("", "checkpoint directory (default: OUT with .checkpoints instead of .h5)")
    local_dir: str = local_dir_option()
    shared_every: int = shared_every_option()
    resume: bool = option(False, "continue from the newest checkpoint in the checkpoint directory")
    progress_every: float = option(2.0, "seconds between progress lines on rank 0 (0 = only the last)")
    eval_every: int = option(0, "compute the error on the whole data set every N iterations (0 = never)")
    target_error: float = option(0.0, "stop once the whole-data relative error is at most this (needs eval_every)")
    samples: int = option(1500, "synthetic: number of signals")
    features: int = option(20, "synthetic: signal length")
    planted_atoms: int = option(0, "synthetic: atoms of the planted dictionary (0 = ATOMS)")
    snr_db: float = option(math.inf, "synthetic: signal-to-noise ratio in dB (inf = no noise)")

    def __post_init__(self) -> None:
        problems = []
        for name in ("atoms", "sparsity", "batch_size", "iterations", "max_replace", "replace_after"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("checkpoint_every", "eval_every", "samples", "features", "planted_atoms"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be 0 or more, got {getattr(self, name)}")
        problems += checkpoint_level_problems(self.local_dir, self.shared_every)
        if self.sparsity > self.atoms:
            problems.append(
                f"sparsity {self.sparsity} exceeds the number of atoms {self.atoms}: a code cannot use more"
            )
        if self.method not in METHODS:
            problems.append(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.in_memory not in IN_MEMORY:
            problems.append(f"in_memory must be one of {', '.join(IN_MEMORY)}, got {self.in_memory!r}")
        if not (self.shuffle_window_mib > 0 and math.isfinite(self.shuffle_window_mib)):
            problems.append(f"shuffle_window_mib must be a positive number, got {self.shuffle_window_mib}")
        problems += coder_problems(self.coder, self.alpha, self.max_residual, self.device)
        if not (self.forgetting >= 0 and math.isfinite(self.forgetting)):
            problems.append(f"forgetting must be a number >= 0, got {self.forgetting}")
        if not 0 < self.duplicate_cosine <= 1:
            problems.append(f"duplicate_cosine must be in (0, 1], got {self.duplicate_cosine}")
        if not self.target_error >= 0:  # (NaN too: never reached, the whole run would pass without a word)
            problems.append(f"target_error must be a number >= 0 (0: none), got {self.target_error}")
        elif self.target_error and not self.eval_every:
            problems.append("target_error needs eval_every > 0 (the whole-data error is what it is compared with)")
        if not self.data:
            if self.features < 1 or self.samples < 1:
                problems.append("the synthetic data set needs samples and features of at least 1")
            if not self.snr_db >= LOWEST_SNR_DB:
                problems.append(f"synthetic: snr_db must be a number of dB >= {LOWEST_SNR_DB:g} (inf: no noise), got "
                                f"{self.snr_db}")  # fmt: skip
            if self.sparsity > self.planted:
                problems.append(f"synthetic: {self.sparsity} non-zeros need at least as many planted atoms")
        if problems:
            raise ValueError("dictlearn settings: " + "; ".join(problems))

    @property
    def planted(self) -> int:
        """Atoms of the planted synthetic dictionary."""
        return self.planted_atoms or self.atoms

    @property
    def data_path(self) -> tuple[str, str]:
        """(file, dataset name) of the signals; the synthetic file sits beside ``out``."""
        if self.data:
            return split_spec(self.data)
        return str(Path(self.out).with_suffix(".synthetic.h5")), "signals"

    def shuffle_window(self, features: int) -> int:
        """Rows in a shuffle window for signals of ``features`` values."""
        return max(1, int(self.shuffle_window_mib * 2**20) // (8 * features))

    @property
    def keep_in_memory(self) -> bool | None:
        """The reader's ``in_memory``: True, False, or None to decide by the free memory."""
        return {"auto": None, "yes": True, "no": False}[self.in_memory]

    @property
    def checkpoints(self) -> str:
        """The checkpoint directory."""
        return self.checkpoint_dir or str(Path(self.out).with_suffix(".checkpoints"))

    def to_dict(self) -> dict:
        """Plain values (for results files and checkpoints)."""
        return asdict(self)


def load_config(path: str | None, overrides: dict) -> DictLearnConfig:
    """Defaults, then the TOML file (top level or a [dictlearn] table), then ``overrides`` (not None)."""
    return load_settings(DictLearnConfig, "dictlearn", path, overrides)


REMOVE_MEAN = ("auto", "yes", "no")


@dataclass
class EncodeConfig:
    """Which atoms code which signals, how, and where the codes go (``mpiscale encode``)."""

    dictionary: str = option(
        "", "the atoms: a results file of mpiscale dictlearn, or any FILE.h5:/dataset or FILE.npy of atoms x features"
    )
    data: str = option(
        "",
        "signals to code, one per row: FILE.h5:/dataset (any HDF5 file), a quoted glob 'run-*.h5:/X', a list "
        "FILES.txt:/X (one path a line), FILE.npy, or FILE.npz:/NAME",
    )
    coder: str = option("omp", "omp (at most SPARSITY atoms, or to an error target) or lasso (L1 penalty alpha)")
    sparsity: int = option(0, "omp: atoms per code at most (0 = the sparsity the dictionary was learned with, or 3)")
    max_residual: float = option(
        0.0, "omp: code each signal only until its residual norm ||x - cD|| is at most this (0 = SPARSITY atoms)"
    )
    alpha: float = option(0.1, "lasso: L1 penalty of the codes")
    remove_mean: str = option(
        "auto", "subtract each signal's mean before coding: yes, no, or auto (as the dictionary was learned)"
    )
    batch_size: int = option(4096, "signals each rank codes per round (a round is written, then marked done)")
    device: str = option("auto", "OMP on cpu, cuda, or auto (a CUDA GPU when present; error targets run on the CPU)")
    out: str = option("codes.h5", "the codes (CSR, readable by h5py and scipy), visible once complete")
    resume: bool = option(False, "go on from the rounds a stopped (OUT.partial) or killed (OUT.tmp) run wrote")
    mark_every: float = mark_every_option()
    progress_every: float = option(2.0, "seconds between progress lines on rank 0 (0 = only the last)")

    def __post_init__(self) -> None:
        problems = coder_problems(self.coder, self.alpha, self.max_residual, self.device)
        problems += mark_every_problems(self.mark_every)
        if self.sparsity < 0 or self.batch_size < 1:
            problems.append(f"sparsity must be 0 or more and batch_size at least 1, got {self.sparsity}, "
                            f"{self.batch_size}")  # fmt: skip
        if self.remove_mean not in REMOVE_MEAN:
            problems.append(f"remove_mean must be one of {', '.join(REMOVE_MEAN)}, got {self.remove_mean!r}")
        if problems:
            raise ValueError("encode settings: " + "; ".join(problems))

    def to_dict(self) -> dict:
        """Plain values (for the codes file)."""
        return asdict(self)
