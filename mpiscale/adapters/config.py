"""Settings of ``mpiscale compress-adapters``: one dataclass, from TOML and the command line."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..jobs import DEVICE_RULE, DEVICES, option
from .algebra import PRECISIONS
from .pca import METHODS


@dataclass
class AdaptersConfig:
    """Which adapters, how many components, and where the compressed file goes."""

    adapters: str = option(
        "",
        "the LoRA adapters (PEFT directories with adapter_config.json and adapter_model.safetensors, or the older "
        "adapter_model.bin): a directory of them, one adapter directory, a quoted glob 'runs/*/adapter', or a list "
        "FILE.txt (one path a line)",
    )
    out: str = option("adapters.h5", "the compressed file: components per layer group, loadings per adapter")
    components: int = option(
        0, "shared components per layer group and side (A, B); 0 = the fewest that explain VARIANCE"
    )
    variance: float = option(0.99, "with COMPONENTS 0: the share of each group's sum of squares to keep")
    max_components: int = option(
        0,
        "with COMPONENTS 0: at most this many per group and side, whatever VARIANCE asks (0 = no cap; the run's "
        "last line says when the compressed form outgrew the adapters)",
    )
    method: str = option(
        "exact",
        "exact (the d x d second moment summed over the ranks, or the Gram matrix when there are fewer rows) or "
        "randomized (a range finder: needs COMPONENTS; for many adapters and a small k)",
    )
    oversampling: int = option(10, "randomized: extra random directions beyond COMPONENTS")
    power_iterations: int = option(
        0,
        "randomized: passes that sharpen the range (one allreduce of d x (k+p) each); 0 = until a pass adds less "
        "than 1e-5 of the share the components capture (at most 30)",
    )
    seed: int = option(0, "randomized: seed of the random directions (the same on every rank)")
    resume: bool = option(
        False, "finish a stopped run: the layer groups it completed are in OUT.partial (any number of ranks)"
    )
    add_to: str = option(
        "",
        "an earlier compressed FILE.h5 the new adapters join (it is read, never changed; OUT is a new file): "
        "components from its stored form and the new adapters together, no need of its adapters' weights",
    )
    progress_every: float = option(2.0, "seconds between progress lines on rank 0 (0 = only the last)")
    device: str = option(
        "auto",
        f"where the products and eigensolvers run (numpy on the CPU, torch on a GPU): cpu, {DEVICE_RULE}",
    )
    precision: str = option(
        "float64",
        "on a GPU: float64, or float32 (the eigensolver in single precision, then one Rayleigh-Ritz step in double "
        "precision refines the kept components; for GPUs with little float64 arithmetic)",
    )

    def __post_init__(self) -> None:
        problems: list[str] = []
        if self.method not in METHODS:
            problems.append(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.components < 0 or self.max_components < 0:
            problems.append(f"components and max_components must be 0 or more, got {self.components} and "
                            f"{self.max_components}")  # fmt: skip
        if not (0 < self.variance <= 1 and math.isfinite(self.variance)):
            problems.append(f"variance must be in (0, 1], got {self.variance}")
        if self.method == "randomized" and self.components == 0:
            problems.append("the randomized method needs COMPONENTS (the range it finds has k + OVERSAMPLING columns)")
        if self.device not in DEVICES:
            problems.append(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.precision not in PRECISIONS:
            problems.append(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.oversampling < 0 or self.power_iterations < 0:
            problems.append("oversampling and power_iterations must be 0 or more")
        if problems:
            raise ValueError("compress-adapters settings: " + "; ".join(problems))

    def to_dict(self) -> dict:
        """Plain values (for the output file)."""
        return asdict(self)
