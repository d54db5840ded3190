"""Settings of ``mpiscale circuits run``: one dataclass, from TOML and the command line."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..jobs import DEVICE_RULE, DEVICES, option


@dataclass
class CircuitsRunConfig:
    """Which circuits, on which data, into which file."""

    catalogue: str = option("", "the circuit catalogue (mpiscale circuits add writes it)")
    data: str = option(
        "", "the inputs: FILE.h5:/dataset (rows of what the circuits' models take), FILE.npy, or FILE.npz:/NAME"
    )
    out: str = option("features.h5", "the output file: one column per circuit, one row per input")
    all_features: bool = option(
        False,
        "run every circuit of the catalogue (or those --where selects): each model's shared prefix once per "
        "batch, each layer's atoms as one matrix product",
    )
    plan: str = option(
        "",
        "a composition plan (TOML: circuits and ops as a graph, compiled over the ranks; its outputs are written "
        "as /outputs/NODE)",
    )
    where: str = option("", "only circuits matching these filters, separated by ';' (e.g. 'layer=hidden2;usage>=10')")
    batch_size: int = option(1024, "input rows per batch (one forward pass of each model)")
    in_flight: int = option(0, "--plan: batches in flight at once (0 = twice the ranks: the ranks work as a pipeline)")
    resume: bool = option(
        False,
        "finish a stopped or killed run from its last written batch (OUT.partial, or OUT.tmp after a kill; "
        "any number of ranks)",
    )
    progress_every: float = option(2.0, "seconds between progress lines on rank 0 (0 = only the last)")
    device: str = option(
        "auto",
        f"where the models run: cpu, {DEVICE_RULE}; the atoms and plan ops run in host memory",
    )

    def __post_init__(self) -> None:
        problems: list[str] = []
        if self.batch_size < 1:
            problems.append(f"batch_size must be at least 1, got {self.batch_size}")
        if self.in_flight < 0:
            problems.append(f"in_flight must be 0 or more, got {self.in_flight}")
        if self.device not in DEVICES:
            problems.append(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.progress_every < 0:
            problems.append(f"progress_every must be 0 or more, got {self.progress_every}")
        if problems:
            raise ValueError("circuits run settings: " + "; ".join(problems))

    def to_dict(self) -> dict:
        """Plain values (for the output file)."""
        return asdict(self)


#: The settings a resumed run must share with the stopped one.
RESULT_SETTINGS = ("catalogue", "data", "all_features", "plan", "where", "batch_size")
