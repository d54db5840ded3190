"""Settings of ``mpiscale train`` and ``mpiscale collect``: dataclasses loaded from TOML and the command line.

Every field has a default that runs on a laptop: with no ``--data``, train
fits an MLP to scikit-learn's bundled handwritten digits, and collect reads
the data set the model was trained on.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from ..jobs import (
    DEVICE_RULE,
    DEVICES,
    checkpoint_level_problems,
    local_dir_option,
    mark_every_option,
    mark_every_problems,
    option,
    shared_every_option,
)

COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")
INTRA_NODE = ("mpi", "nccl", "gloo")
BATCHINGS = ("sequential", "round-robin", "memory")
MODELS = ("mlp", "transformer")


def _positive(config, names: tuple[str, ...], problems: list[str]) -> None:
    for name in names:
        value = getattr(config, name)
        if not (value > 0 and math.isfinite(value)):
            problems.append(f"{name} must be a positive number, got {value}")


@dataclass
class TrainConfig:
    """What to train on, the model, the optimizer, and where checkpoints and results go."""

    data: str = option(
        "",
        "training data: an HDF5 file (or an index of several), or a NumPy .npz archive, holding the INPUTS and LABELS "
        "data sets, one sample per row; empty = scikit-learn's bundled handwritten digits (8x8 images) for the "
        "MLP, or for the transformer synthetic sequences (24 tokens of 16, labelled by the most frequent of tokens "
        "0-3), written beside OUT",
    )
    inputs: str = option("inputs", "the data set of inputs in DATA (rows; further axes are flattened)")
    labels: str = option(
        "labels",
        "the integer class labels (0 .. classes-1): a data set in DATA (a bare name), or a file of their own, FILE "
        "or FILE:/DATASET (a y.npy beside DATA's X.npy)",
    )
    offsets: str = option(
        "",
        "ragged INPUTS (token sequences of varying length, for the transformer): the data set of each sequence's "
        "start in the flat INPUTS (N starts, or N+1 boundaries ending at the number of tokens); a variable-length "
        "INPUTS data set needs none",
    )
    batching: str = option(
        "sequential",
        "how samples make batches: sequential (BATCH_SIZE per step, each rank a block of it), round-robin (the "
        "same, samples dealt across the ranks) or memory (ragged inputs: each rank's batch at most BATCH_TOKENS "
        "padded tokens, sequences of similar length together; a step is one batch per rank)",
    )
    batch_tokens: int = option(
        0, "memory batching: the most tokens (sequences x the longest of them) in one rank's batch"
    )
    prefetch_mib: float = option(
        0.0, "round-robin and memory batching: MiB of batches read ahead (0 = two batches' worth)"
    )
    validation: str = option(
        "", "held-out data with the same data sets, scored after every epoch (the digits: their last 20%%)"
    )
    validation_labels: str = option(
        "",
        "the held-out labels where they are not VALIDATION's LABELS data set: a data set in VALIDATION, or a file "
        "of their own, FILE or FILE:/DATASET (needed where LABELS is a file of its own)",
    )
    model: str = option(
        "mlp",
        "mlp (HIDDEN layers over rows of numbers) or transformer (an encoder of ENCODER_LAYERS over rows of integer "
        "token ids, mean-pooled into the classifier)",
    )
    hidden: tuple[int, ...] = option((128, 64), "mlp: widths of the hidden layers (ReLU after each)")
    width: int = option(64, "transformer: the embedding width (a multiple of HEADS)")
    heads: int = option(4, "transformer: attention heads per layer")
    encoder_layers: int = option(2, "transformer: self-attention layers")
    epochs: int = option(20, "passes over the training data")
    batch_size: int = option(64, "global mini-batch (split over the ranks; the last partial batch is dropped)")
    learning_rate: float = option(1e-3, "Adam's step size")
    weight_decay: float = option(0.0, "Adam's L2 penalty")
    seed: int = option(0, "seed of the initial weights and of the batch order")
    bucket_mib: float = option(25.0, "gradient bucket size in MiB, after the first")
    first_bucket_mib: float = option(
        1.0, "the first gradient bucket's size in MiB (small, as in DDP, so communication starts early in backward)"
    )
    compression: str = option(
        "none",
        "gradients on the wire: none (float32), fp16 or bf16 (16-bit, half the bytes), or powersgd (low-rank "
        "factors with error feedback; the residuals restart from zero on --resume)",
    )
    intra_node: str = option(
        "mpi",
        "data-parallel: how gradients are summed inside a node: mpi (the runtime's hierarchical allreduce), nccl "
        "(torch.distributed's NCCL on the GPUs, then MPI between the nodes' first ranks: --device cuda) or gloo (the "
        "same path for the CPU)",
    )
    powersgd_rank: int = option(4, "powersgd: rank of the factors")
    powersgd_start: int = option(10, "powersgd: exact steps before compression starts")
    stages: int = option(
        1,
        "pipeline stages: the model cut into STAGES parts of balanced parameter count, each on its own rank; the "
        "ranks must be a multiple (STAGES x replicas, each stage's replicas averaging their gradients)",
    )
    micro_batches: int = option(
        1, "micro-batches each replica's share of a batch is cut into and pipelined (with STAGES or alone)"
    )
    schedule: str = option("1f1b", "pipeline schedule: 1f1b (at most STAGES micro-batches held) or gpipe")
    out: str = option("model.h5", "results file: the trained weights, learning curves, settings")
    checkpoint_every: int = option(0, "checkpoint every N steps (0 = never)")
    checkpoint_dir: str = option("", "checkpoint directory (default: OUT with .checkpoints instead of .h5)")
    local_dir: str = local_dir_option()
    shared_every: int = shared_every_option()
    resume: bool = option(False, "continue from the newest checkpoint (also on another number of ranks)")
    progress_every: float = option(2.0, "seconds between progress lines on rank 0 (0 = only the last)")
    device: str = option(
        "auto",
        f"where the model (or this rank's pipeline stage), its optimizer and the batches live: cpu, {DEVICE_RULE}",
    )

    def __post_init__(self) -> None:
        problems: list[str] = []
        if self.device not in DEVICES:
            problems.append(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.intra_node not in INTRA_NODE:
            problems.append(f"intra_node must be one of {', '.join(INTRA_NODE)}, got {self.intra_node!r}")
        elif self.intra_node != "mpi" and (self.compression != "none" or self.pipelined):
            problems.append("intra_node nccl or gloo sums float32 gradients of data-parallel training: use it without "
                            "compression, STAGES or MICRO_BATCHES")  # fmt: skip
        if self.compression not in COMPRESSIONS:
            problems.append(f"compression must be one of {', '.join(COMPRESSIONS)}, got {self.compression!r}")
        if self.model not in MODELS:
            problems.append(f"model must be one of {', '.join(MODELS)}, got {self.model!r}")
        if self.batching == "adaptive":
            problems.append("batching adaptive chooses batches from timings, so a run would not be repeatable "
                            "or resumable step for step: use memory with BATCH_TOKENS")  # fmt: skip
        elif self.batching not in BATCHINGS:
            problems.append(f"batching must be one of {', '.join(BATCHINGS)}, got {self.batching!r}")
        if self.batching == "memory" and self.batch_tokens < 1:
            problems.append("batching memory needs BATCH_TOKENS: the most padded tokens in one rank's batch")
        if self.batch_tokens < 0:
            problems.append(f"batch_tokens must be 0 or more, got {self.batch_tokens}")
        if not (self.prefetch_mib >= 0 and math.isfinite(self.prefetch_mib)):
            problems.append(f"prefetch_mib must be a number >= 0, got {self.prefetch_mib}")
        if self.powersgd_start < 0:
            problems.append(f"powersgd_start must be 0 or more, got {self.powersgd_start}")
        if self.schedule != "1f1b":  # imported only then: the pipeline package brings torch
            from .pipeline.schedule import SCHEDULES

            if self.schedule not in SCHEDULES:
                problems.append(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.pipelined and self.compression != "none":
            problems.append("compression applies to data-parallel training only: drop it, or use STAGES 1 and "
                            "MICRO_BATCHES 1")  # fmt: skip
        for name in ("epochs", "batch_size", "powersgd_rank", "stages", "micro_batches", "width", "heads",
                     "encoder_layers"):  # fmt: skip
            if getattr(self, name) < 1:
                problems.append(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.width >= 1 and self.heads >= 1 and self.width % self.heads:
            problems.append(f"width must be a multiple of heads, got width {self.width} and {self.heads} heads")
        if self.checkpoint_every < 0:
            problems.append(f"checkpoint_every must be 0 or more, got {self.checkpoint_every}")
        problems += checkpoint_level_problems(self.local_dir, self.shared_every)
        _positive(self, ("learning_rate", "bucket_mib", "first_bucket_mib"), problems)
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            problems.append(f"weight_decay must be a number >= 0, got {self.weight_decay}")
        if any(width < 1 for width in self.hidden):
            problems.append(f"hidden layer widths must be at least 1, got {list(self.hidden)}")
        if self.validation and not self.data:
            problems.append("validation needs DATA: the bundled digits bring their own held-out set")
        if self.validation_labels and not self.validation:
            problems.append("validation_labels are the labels of VALIDATION: give the held-out data too")
        if problems:
            raise ValueError("train settings: " + "; ".join(problems))

    @property
    def pipelined(self) -> bool:
        """Trained as a pipeline (stages or micro-batches), not by plain data parallelism."""
        return self.stages > 1 or self.micro_batches > 1

    @property
    def widths(self) -> list[int]:
        """The hidden layers' widths."""
        return list(self.hidden)

    @property
    def checkpoints(self) -> str:
        """The checkpoint directory."""
        return self.checkpoint_dir or str(Path(self.out).with_suffix(".checkpoints"))

    def to_dict(self) -> dict:
        """Plain values (for results files and checkpoints)."""
        return asdict(self)


@dataclass
class CollectConfig:
    """Which model, which data, which layers, and where the activations go."""

    model: str = option("model.h5", "a results file of mpiscale train (the weights and the model's shape)")
    data: str = option(
        "", "inputs to run through the model: FILE.h5:/dataset (rows); empty = the data the model was trained on"
    )
    labels: str = option(
        "",
        "FILE.h5:/dataset of class labels of DATA's rows, named in the output for inspect --top-inputs "
        "(default: the training labels when DATA is the training data)",
    )
    offsets: str = option(
        "",
        "ragged DATA (token sequences of varying length): the data set of each sequence's start in the flat DATA "
        "(default: the training run's, when DATA is the training data; none for a variable-length data set)",
    )
    layers: tuple[str, ...] = option(("relu1",), "modules whose outputs to keep (mpiscale inspect MODEL.h5 lists them)")
    out: str = option("activations.h5", "output file: one data set per layer, rows in input order, and sample_ids")
    batch_size: int = option(4096, "rows each rank reads and writes at once (bounds its memory)")
    batch_tokens: int = option(
        0,
        "ragged DATA: the most padded tokens (sequences x the longest of them) run through the model at once, "
        "sequences of similar length together; 0 = the model's own training budget (its --batch-tokens, else its "
        "--batch-size sequences of its longest)",
    )
    progress_every: float = option(2.0, "seconds between progress lines on rank 0 (0 = only the last)")
    device: str = option(
        "auto",
        f"where the model runs: cpu, {DEVICE_RULE}",
    )
    resume: bool = option(False, "go on from the rows a stopped (OUT.partial) or killed (OUT.tmp) run collected")
    mark_every: float = mark_every_option()

    def __post_init__(self) -> None:
        problems = mark_every_problems(self.mark_every)
        if self.device not in DEVICES:
            problems.append(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.batch_size < 1:
            problems.append(f"batch_size must be at least 1, got {self.batch_size}")
        if self.batch_tokens < 0:
            problems.append(f"batch_tokens must be 0 or more, got {self.batch_tokens}")
        if not self.layer_names:
            problems.append("layers must name at least one module")
        if problems:
            raise ValueError("collect settings: " + "; ".join(problems))

    @property
    def layer_names(self) -> list[str]:
        """The modules to capture, in the order given."""
        return [name.strip() for name in self.layers if name.strip()]

    def to_dict(self) -> dict:
        """Plain values (for the output file)."""
        return asdict(self)
