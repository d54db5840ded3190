"""What both kinds of training share before and after their steps: the outputs claimed, the data read and checked
against the model, the steps of every epoch, the checkpoint a resumed run continues, and the results file.

The data-parallel job (:mod:`.data_parallel_job`) and the pipeline job (:mod:`.pipeline.job`) each build their
own steps on these; neither imports the other.
"""

from __future__ import annotations

import logging
import math
import socket
from functools import partial

import numpy as np
import torch

from ..io import Checkpointer, CheckpointError, DataFileError, OutputLock, Restored
from ..jobs import Ended, Plan, claim_outputs, restore_compatible, write_results
from ..kernels.threads import share_cores
from ..ranks import Comm, ranks_sharing_cores
from ..runtime import ActorSystem, JobRefused
from ..words import counted
from .batches import TrainingSteps, training_steps, uses_samples
from .bundled import write_digits, write_sequences
from .config import TrainConfig
from .curves import Curves
from .data import LabelledData, check_classes, check_labelled, check_ragged, is_ragged, names_a_file
from .held_out import check_scoring_budget
from .model import TRANSFORMER, build_model, set_standardization
from .pipeline.state import INDEX as PIPELINE_INDEX
from .pipeline.state import NO_ROWS
from .results import RESULTS_FORMAT, TrainResults, write

log = logging.getLogger(__name__)

#: Settings a checkpoint must share with the run that resumes it.
COMPATIBLE = ("hidden", "batch_size", "seed", "learning_rate", "weight_decay")


async def finish_training(
    system: ActorSystem,
    config: TrainConfig,
    comm: Comm,
    data: LabelledData,
    validation: LabelledData | None,
    spec: dict,
    model: torch.nn.Module | None,
    curves: Curves,
    threads: int,
    ended: Ended,
    device: str = "cpu",
    gradient_path: str = "",
) -> dict:
    """Rank 0 writes the results file of ``model`` (the whole model there, in host memory; None elsewhere), every
    rank agrees; the summary every rank returns. ``device``: where it trained (``jobs.recorded_devices``);
    ``gradient_path``: how its gradients were averaged (``DataParallel.gradient_path``)."""
    hosts = sorted(set(comm.allgather(socket.gethostname())))
    score = ""
    if curves.epochs["validation_accuracy"]:
        score = f"; held-out accuracy {curves.epochs['validation_accuracy'][-1]:.1%}"
    done = f"wrote {config.out}: {ended.done} steps on {counted(system.size, 'rank')}{score}"
    failed = f"mpiscale train: could not write {config.out}: {{}}".format
    if model is not None:
        results = TrainResults(config, data, validation, spec, model, curves, system.size, hosts, threads, device,
                               gradient_path)  # fmt: skip
        writer = partial(write, results=results)
    await write_results(system, config.out, writer if model is not None else _nothing, done, failed)
    loss = curves.steps["loss"][-1] if curves.done else None
    return {"steps": ended.done, "loss": loss, "score": score}


def _nothing(file) -> None:
    raise AssertionError("only rank 0 writes the results file")


def claim_training_outputs(config: TrainConfig, comm: Comm) -> tuple[int, OutputLock | None]:
    """(torch threads per rank, now set; the results file's lock): the outputs checked, none of them an input, and
    locked against a second job (collective)."""
    threads = share_cores(ranks_sharing_cores(comm))
    torch.set_num_threads(threads)
    # the checkpoints are always open: a stop checkpoints without periodic ones too
    labels = [spec for spec in (config.labels, config.validation_labels) if names_a_file(spec)]
    return threads, claim_outputs(
        config.out, config.checkpoints, [config.data, config.validation, *labels], comm, RESULTS_FORMAT
    )


def checked_steps(config: TrainConfig, data: LabelledData, comm: Comm, replicas: int) -> TrainingSteps:
    """The steps of every epoch for ``replicas`` replicas, refused when an epoch makes none (collective)."""
    schedule = training_steps(config, data, comm, replicas)
    if not min(schedule.per_epoch):
        raise ValueError(
            f"batching {config.batching} with {config.batch_tokens} tokens makes fewer batches an epoch than the "
            f"{replicas} replicas of a step: lower --batch-tokens"
        )
    return schedule


def training_plan(config: TrainConfig, schedule: TrainingSteps) -> Plan:
    """How the lifecycle counts, shows and saves the steps of a training run."""
    return Plan("step", "samples", schedule.total, config.progress_every, config.checkpoint_every, True,
                checkpoint_at_end=config.checkpoint_every > 0)  # fmt: skip


def prepare_data(
    config: TrainConfig, comm: Comm
) -> tuple[LabelledData, LabelledData | None, dict, torch.nn.Sequential]:
    """(training data, held-out data or None, the model's spec, the initial model), the data checked, also against
    the model and the batch size; the weights drawn from the seed (collective)."""
    transformer = config.model == TRANSFORMER
    if config.data:
        train_path, validation_path = config.data, config.validation
    else:
        train_path, validation_path = (write_sequences if transformer else write_digits)(config.out, comm)
    if is_ragged(train_path, config.inputs, config.offsets):
        return _prepare_ragged(config, comm, train_path, validation_path)
    if config.batching == "memory":
        raise DataFileError(train_path, (
            "batching memory bounds batches by tokens: it takes ragged inputs (give --offsets, or a variable-length "
            "data set); batch rows of one size with --batch-size"
        ), config.inputs)  # fmt: skip
    data, classes, mean, std = check_labelled(train_path, config.inputs, config.labels, comm)
    validation = None
    if validation_path:
        held_out_labels = _held_out_labels(config, data)
        validation, held_out_classes, _, _ = check_labelled(validation_path, config.inputs, held_out_labels, comm)
        if validation.features != data.features:
            raise DataFileError(
                validation_path, f"rows of {validation.features} values, the training rows have {data.features}"
            )
        classes = _with_held_out(validation_path, classes, held_out_classes)
    check_classes(data, classes)
    if config.batch_size > data.samples:
        raise ValueError(f"batch size {config.batch_size} exceeds the {data.samples} training samples")
    torch.manual_seed(config.seed)
    if transformer:
        spec = _transformer_spec(config, data, validation, classes, data.features)
        return data, validation, spec, build_model(spec)
    spec = {"inputs": data.features, "hidden": config.widths, "classes": classes}
    model = build_model(spec)
    set_standardization(model, mean, std)
    return data, validation, spec, model


def _prepare_ragged(
    config: TrainConfig, comm: Comm, train_path: str, validation_path: str
) -> tuple[LabelledData, LabelledData | None, dict, torch.nn.Sequential]:
    """``prepare_data`` for token sequences of varying length (the transformer, padded and masked)."""
    if config.model != TRANSFORMER:
        raise DataFileError(train_path, (
            "the inputs are sequences of varying length: they need --model transformer (an MLP takes rows of one "
            "size)"
        ), config.inputs)  # fmt: skip
    data, classes = check_ragged(train_path, config.inputs, config.offsets, config.labels, comm)
    validation = None
    if validation_path:
        validation, held_out_classes = check_ragged(validation_path, config.inputs, config.offsets,
                                                    _held_out_labels(config, data), comm)  # fmt: skip
        classes = _with_held_out(validation_path, classes, held_out_classes)
        check_scoring_budget(validation, config)
    check_classes(data, classes)
    if config.batching != "memory" and config.batch_size > data.samples:
        raise ValueError(f"batch size {config.batch_size} exceeds the {data.samples} training samples")
    torch.manual_seed(config.seed)
    longest = max(data.features, validation.features if validation is not None else 0)
    spec = _transformer_spec(config, data, validation, classes, longest, ragged=True)
    return data, validation, spec, build_model(spec)


def _held_out_labels(config: TrainConfig, data: LabelledData) -> str:
    """The labels setting of the held-out data: VALIDATION_LABELS, else the data set LABELS names in DATA (``DATA:/y``
    too: named so, the training file's labels were the held-out ones), unless the training labels are a file of
    their own (they were scored as the held-out labels, or refused as too few, without a word)."""
    if config.validation_labels or not data.label_file:
        return config.validation_labels or data.labels
    raise ValueError(
        f"--labels {config.labels} is a file of the training labels: give the held-out labels too, as "
        "--validation-labels FILE (or FILE:/DATASET, or a data set of --validation)"
    )


def _with_held_out(validation_path: str, classes: int, held_out_classes: int) -> int:
    if held_out_classes > classes:
        log.warning("%s has labels up to %d, unseen in training", validation_path, held_out_classes - 1)
    return max(classes, held_out_classes)


def _transformer_spec(
    config: TrainConfig, data: LabelledData, validation: LabelledData | None, classes: int, length: int,
    ragged: bool = False,
) -> dict:  # fmt: skip
    spec = {"kind": TRANSFORMER, "vocab": _vocabulary(data, validation), "length": length, "width": config.width,
            "heads": config.heads, "layers": config.encoder_layers, "classes": classes}  # fmt: skip
    return spec | {"ragged": True} if ragged else spec


#: The largest vocabulary a transformer takes: token ids beyond it are a mistake (ids not renumbered), not a model.
MAX_VOCABULARY = 1 << 24


def _vocabulary(data: LabelledData, validation: LabelledData | None) -> int:
    """One more than the largest token id of both files, which must hold integers 0 .. MAX_VOCABULARY - 1."""
    for checked in (data, validation):
        if checked is None:
            continue
        if not checked.integers:
            raise DataFileError(checked.path, (
                "the transformer takes integer token ids, one sequence per row; these inputs are not integers "
                "(use --model mlp for rows of numbers)"
            ), checked.inputs)  # fmt: skip
        if checked.lowest < 0 or checked.highest >= MAX_VOCABULARY:
            raise DataFileError(checked.path, (
                f"token ids must lie in 0 .. {MAX_VOCABULARY - 1}, found {checked.lowest:.0f} .. {checked.highest:.0f} "
                "(renumber them, e.g. with numpy.unique(tokens, return_inverse=True))"
            ), checked.inputs)  # fmt: skip
    return int(max(data.highest, validation.highest if validation is not None else 0)) + 1


def compatibility(config: TrainConfig, data: LabelledData, spec: dict, schedule: TrainingSteps) -> dict:
    """The settings a checkpoint must share with the run that resumes it, the data's fingerprint among them: the
    batching too where it is not the fixed rows' sequential one (so checkpoints of earlier versions still match),
    and with memory batching the replicas (a step is one batch per replica: on other replicas, step N is elsewhere
    in the data)."""
    settings = {name: getattr(config, name) for name in COMPATIBLE} | {"samples": data.samples, "spec": spec}
    settings["data"] = data.fingerprint
    settings["hidden"] = ",".join(map(str, config.hidden))  # as checkpoints of earlier versions hold it
    if uses_samples(config, data):
        settings |= {"batching": config.batching, "batch_tokens": config.batch_tokens}
    if config.batching == "memory":
        settings["replicas"] = schedule.replicas
    return settings


def restored_training(
    config: TrainConfig, data: LabelledData, spec: dict, checkpoints: Checkpointer, pipelined: bool,
    schedule: TrainingSteps,
) -> Restored | None:  # fmt: skip
    """The checkpoint a resumed run continues (None: none, or not resuming), refused unless it is within the run's
    steps, of the same kind of training (data-parallel, or pipeline: ``pipelined``) and of the same settings."""
    total = schedule.total

    def usable(restored: Restored) -> None:
        if restored.step > total:
            raise CheckpointError(
                f"the newest checkpoint in {config.checkpoints} is at step {restored.step}, past the {total} steps of "
                f"{config.epochs} epochs: give more --epochs to continue it"
            )
        if pipelined and PIPELINE_INDEX not in restored.meta:
            raise CheckpointError(
                f"the checkpoint in {config.checkpoints} is of data-parallel training (no --stages or "
                "--micro-batches): resume it without them"
            )
        if not pipelined and PIPELINE_INDEX in restored.meta:
            raise CheckpointError(
                f"the checkpoint in {config.checkpoints} is of pipeline training: resume it with --stages or "
                "--micro-batches (any: --micro-batches 2 alone trains as one stage)"
            )

    expected = compatibility(config, data, spec, schedule)
    rows = NO_ROWS if pipelined else None  # a pipeline rank's range comes from the checkpoint's index
    why = {"data": (
        "the inputs or labels differ from those the checkpoint trained on: written again, or replaced; resume on "
        "the data it trained on, or start afresh with another --checkpoint-dir"
    ), "replicas": (
        "with --batching memory a step is one batch per data-parallel replica, so on another number of replicas "
        "the checkpoint's step lies elsewhere in the data: resume on the replicas it was saved with (ranks, or "
        "ranks / --stages), or start afresh with another --checkpoint-dir"
    )}  # fmt: skip
    earlier = {"data": data.fingerprint}  # a checkpoint of an earlier version kept no fingerprint: taken as it was
    restored = restore_compatible(
        checkpoints, config.resume, config.checkpoints, expected, "step", usable, rows, why, added=earlier
    )
    if restored is None and config.resume and checkpoints.rank == 0:
        log.warning("--resume: no checkpoint in %s, starting from the beginning", config.checkpoints)
    return restored


def refuse_divergence(
    loss: float, step: int, epoch: int, config: TrainConfig, checkpoints: Checkpointer | None
) -> None:
    """End the job at the first step whose mean loss (every rank holds it alike, after the step's allreduce) is not
    finite: the weights are lost from that step on, and the job went on to write a model of NaN with status 0.
    Collective where it ends the job (it lists the checkpoints saved, to say what blocks a fresh start)."""
    if math.isfinite(loss):
        return
    saved = checkpoints is not None and checkpoints.steps()
    kept = (f" with another --checkpoint-dir, or remove {config.checkpoints} (its checkpoints keep this rate, and a "
            "resume must keep it)" if saved else "")  # fmt: skip
    raise JobRefused(f"mpiscale train: the loss is {loss} at step {step} (epoch {epoch + 1}): training diverged, and "
                     f"its weights are lost; no results were written. Lower --learning-rate ({config.learning_rate:g} "
                     f"now) and start again{kept}", status=1)  # fmt: skip


def progress_text(epoch: int, curves: Curves) -> str:
    recent = slice(-20, None)
    time_s = np.diff([0.0, *curves.steps["time_s"]])[recent]
    share = sum(curves.steps["comm_wait_s"][recent]) / max(float(np.sum(time_s)), 1e-9)
    held_out = curves.epochs["validation_accuracy"]
    score = f"  held-out {held_out[-1]:.1%}" if held_out else ""
    return (
        f"epoch {epoch + 1}  loss {np.mean(curves.steps['loss'][recent]):.4f}  "
        f"accuracy {np.mean(curves.steps['accuracy'][recent]):.1%}{score}  comm wait {share:.0%}"
    )
