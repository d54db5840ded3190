"""The results file of a training job (``mpiscale.train-results/1``): weights, curves, and how to load the model.

Layout, all readable with plain h5py:

- ``/model/<name>``: every parameter and buffer of the model (``state_dict`` names);
- ``/curves/step/<metric>`` (loss, accuracy, time_s, comm_wait_s: one row per step) and
  ``/curves/epoch/<metric>`` (epoch, validation_loss, validation_accuracy);
- attributes: the usual mpiscale ones (version, format, created, world size, config),
  ``model`` (the model's shape as JSON: inputs, hidden widths, classes; or the transformer's kind,
  vocab, length, width, heads, layers, classes), ``data`` and
  ``validation`` (FILE:/dataset), ``labels``, ``samples``, ``steps``, ``hosts``,
  ``threads_per_rank``, ``device`` (where it trained: ``cpu``, ``cuda:K``, or each rank's as
  JSON) and ``image_shape`` when the inputs are images.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import h5py
import numpy as np
import torch

from ..io import open_file, stamp
from ..words import counted
from .config import TrainConfig
from .curves import EPOCH_METRICS, STEP_METRICS, Curves
from .data import LabelledData
from .model import build_model, describe, module_names
from .state import load_model_arrays, model_arrays

RESULTS_FORMAT = "mpiscale.train-results/1"


@dataclass(frozen=True)
class TrainResults:
    """What a finished training job writes."""

    config: TrainConfig
    data: LabelledData
    validation: LabelledData | None
    spec: dict
    model: torch.nn.Module
    curves: Curves
    world_size: int
    hosts: list[str]
    threads: int
    device: str  # where it trained: "cpu", "cuda:0", or each rank's as JSON
    gradient_path: str = ""  # how the gradients were averaged (DataParallel.gradient_path); "" for pipelines


def write(file: h5py.File, results: TrainResults) -> None:
    """The results into an open (new) file; ``jobs.write_results`` gives it a temporary name, then renames it."""
    stamp(file, RESULTS_FORMAT, results.world_size, results.config.to_dict())
    weights = file.create_group("model")
    for name, array in model_arrays(results.model).items():
        weights.create_dataset(name.removeprefix("model."), data=array)
    for kind, values in (("step", results.curves.steps), ("epoch", results.curves.epochs)):
        group = file.create_group(f"curves/{kind}")
        for metric, series in values.items():
            group.create_dataset(metric, data=np.asarray(series, np.float64))
    data = results.data
    file.attrs["model"] = json.dumps(results.spec)
    file.attrs["data"] = data.spec
    labels_file, labels_name = data.label_source
    file.attrs["labels"] = f"{labels_file}:/{labels_name}" if labels_name else labels_file
    file.attrs["validation"] = results.validation.spec if results.validation is not None else ""
    file.attrs["samples"] = data.samples
    file.attrs["steps"] = results.curves.done
    file.attrs["hosts"] = json.dumps(results.hosts)
    file.attrs["threads_per_rank"] = results.threads
    file.attrs["device"] = results.device
    if results.gradient_path:
        file.attrs["gradient_path"] = results.gradient_path
    if data.patch_shape is not None:
        file.attrs["image_shape"] = data.patch_shape


def load_trained(path: str) -> tuple[torch.nn.Sequential, dict]:
    """The trained model of a results file, ready for inference, and the file's attributes."""
    with open_file(path, (RESULTS_FORMAT,)) as file:
        attrs = {key: file.attrs[key] for key in file.attrs}
        arrays = {f"model.{name}": file["model"][name][()] for name in file["model"]}
    model = build_model(json.loads(attrs["model"]))
    load_model_arrays(model, arrays, path)
    model.eval()
    return model, attrs


def summarize(path: str) -> str:
    """A short text report: the model, the data, the run, the last scores."""
    model, attrs = load_trained(path)
    with open_file(path, (RESULTS_FORMAT,)) as file:
        steps = {name: file["curves/step"][name][()] for name in STEP_METRICS}
        epochs = {name: file["curves/epoch"][name][()] for name in EPOCH_METRICS}
    spec, config = json.loads(attrs["model"]), json.loads(attrs["config"])
    parameters = sum(p.numel() for p in model.parameters())
    lines = [
        f"{path}: {describe(spec)} ({parameters:,} parameters), trained on {counted(int(attrs['world_size']), 'rank')} "
        f"({', '.join(json.loads(attrs['hosts']))}) on {attrs.get('device', 'cpu')}, "
        f"mpiscale {attrs['mpiscale_version']}, {attrs['created']}",
        f"data: {attrs['data']} ({attrs['samples']} samples); held out: {attrs['validation'] or 'none'}",
        f"layers (for mpiscale collect --layers): {', '.join(module_names(model))}",
    ]
    done = int(attrs["steps"])
    if done:
        time_s = steps["time_s"][-1]
        wait = steps["comm_wait_s"].sum()
        last = slice(-20, None)
        lines += [
            f"steps: {done} (batch {config['batch_size']}, {config['epochs']} epochs); training time {time_s:.2f} s, "
            f"{done * config['batch_size'] / max(time_s, 1e-9):,.0f} samples/s; "
            f"waiting for gradients {wait / time_s:.1%}",
            f"last 20 steps: loss {steps['loss'][last].mean():.4f}, accuracy {steps['accuracy'][last].mean():.1%}",
        ]
    if len(epochs["epoch"]):
        lines.append(
            f"held-out after epoch {int(epochs['epoch'][-1])}: loss {epochs['validation_loss'][-1]:.4f}, "
            f"accuracy {epochs['validation_accuracy'][-1]:.1%}"
        )
    return "\n".join(lines)


def plot(path: str, image: str) -> None:
    """Loss and accuracy per step, and the held-out scores per epoch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open_file(path, (RESULTS_FORMAT,)) as file:
        steps = {name: file["curves/step"][name][()] for name in STEP_METRICS}
        epochs = {name: file["curves/epoch"][name][()] for name in EPOCH_METRICS}
    per_epoch = len(steps["loss"]) / max(len(epochs["epoch"]), 1)
    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].semilogy(np.arange(1, len(steps["loss"]) + 1), steps["loss"], label="training loss (batch)")
    axes[1].plot(np.arange(1, len(steps["accuracy"]) + 1), steps["accuracy"], label="training accuracy (batch)")
    if len(epochs["epoch"]):
        at = epochs["epoch"] * per_epoch
        axes[0].semilogy(at, epochs["validation_loss"], "o-", label="held-out loss")
        axes[1].plot(at, epochs["validation_accuracy"], "o-", label="held-out accuracy")
    for axis, title, label in zip(
        axes, ("Loss", "Accuracy"), ("cross-entropy per sample", "share correct"), strict=True
    ):
        axis.set_title(title)
        axis.set_xlabel("step")
        axis.set_ylabel(label)
        axis.legend()
    figure.suptitle(path)
    figure.tight_layout()
    figure.savefig(image, dpi=120)
    plt.close(figure)
