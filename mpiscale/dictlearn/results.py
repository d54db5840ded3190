"""The results file of a dictionary-learning job (``mpiscale.dictlearn-results/1``), its summary and plots.

Layout, all readable with plain h5py:

- ``/dictionary`` (atoms x features), the learned unit-norm atoms;
- ``/metrics/<name>`` (see ``history.METRICS``), ``/metrics/atom_usage`` (rows x
  atoms, codes using each atom) and ``/metrics/iteration`` (the iteration ending
  each row): one row per ``every`` iterations (an attribute of ``/metrics``), so
  about 1,000 rows per run and one per iteration for runs up to 1,000;
- ``/planted_dictionary`` for synthetic data, with the attribute ``recovery_rate``;
- attributes: the usual mpiscale ones (version, format, created, world size,
  config), plus ``hosts``, ``device``, ``data``, ``samples``, ``features``,
  ``stop_reason`` (``iterations``, ``target_error``, or ``stopped`` by a control command) and
  ``patch_shape`` when the data set has one.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import h5py
import numpy as np

from ..io import open_file, recorded, stamp
from ..words import counted
from .config import DictLearnConfig
from .data import DataInfo
from .history import METRICS, History
from .update import close_pairs

RESULTS_FORMAT = "mpiscale.dictlearn-results/1"


@dataclass(frozen=True)
class JobResults:
    """What a finished job writes to its results file."""

    config: DictLearnConfig
    info: DataInfo
    dictionary: np.ndarray
    history: History
    planted: np.ndarray | None  # synthetic data only
    recovery_rate: float | None  # of the planted atoms, synthetic data only
    world_size: int
    hosts: list[str]
    devices: list[str]  # one label per rank ("cpu", "cuda:0")
    threads: int  # Numba threads per rank
    stop_reason: str


def results_bytes(results: JobResults) -> int:
    """About what the results file takes on disk (the arrays; HDF5's metadata is small beside them)."""
    arrays = [results.dictionary, results.planted, results.history.to_arrays()["usage"]]
    metrics = sum(len(values) for values in results.history.metrics.values()) * 8
    return sum(a.nbytes for a in arrays if a is not None) + metrics


def write(file: h5py.File, results: JobResults) -> None:
    """The results into an open (new) file; ``jobs.write_results`` gives it a temporary name, then renames it."""
    config, info, history, dictionary = results.config, results.info, results.history, results.dictionary
    stamp(file, RESULTS_FORMAT, results.world_size, config.to_dict())
    file.create_dataset("dictionary", data=dictionary)
    metrics = file.create_group("metrics")
    metrics.attrs["every"] = history.every
    for name, values in history.metrics.items():
        metrics.create_dataset(name, data=np.asarray(values, dtype=np.float64))
    metrics.create_dataset("atom_usage", data=history.to_arrays()["usage"])
    metrics.create_dataset("iteration", data=history.row_ends())
    file.attrs["iterations"] = history.iterations
    if results.planted is not None:
        file.create_dataset("planted_dictionary", data=results.planted)
        file.attrs["recovery_rate"] = results.recovery_rate
    file.attrs["hosts"] = json.dumps(results.hosts)
    devices = results.devices
    file.attrs["device"] = devices[0] if len(set(devices)) == 1 else json.dumps(devices)
    file.attrs["numba_threads_per_rank"] = results.threads
    file.attrs.update(recorded("data", info.spec, config.out))  # absolute, and relative to the results file
    file.attrs["samples"], file.attrs["features"] = info.samples, info.features
    file.attrs["stop_reason"] = results.stop_reason
    if info.patch_shape is not None:
        file.attrs["patch_shape"] = info.patch_shape


@dataclass(frozen=True)
class LearnedDictionary:
    """What a job's results file holds, as ``load_results`` reads it."""

    path: str
    dictionary: np.ndarray  # atoms x features, unit rows
    config: DictLearnConfig  # the job's settings
    iterations: int
    samples: int
    features: int
    data: str  # the data as the job read it (absolute)
    stop_reason: str
    world_size: int
    metrics: dict[str, np.ndarray]  # per name of ``history.METRICS``, one value per row
    rows_end: np.ndarray  # the iteration that ends each row of the metrics
    atom_usage: np.ndarray  # rows x atoms: codes that used each atom
    planted: np.ndarray | None  # synthetic data only
    recovery_rate: float | None
    patch_shape: tuple[int, ...] | None


def load_results(path: str) -> LearnedDictionary:
    """The dictionary, settings and record of a ``mpiscale dictlearn`` results file (any rank count wrote it)."""
    with open_file(path, (RESULTS_FORMAT,)) as file:
        settings = json.loads(file.attrs["config"])
        known = {name: value for name, value in settings.items() if name in DictLearnConfig.__dataclass_fields__}
        group = file["metrics"]
        return LearnedDictionary(
            path=path,
            dictionary=file["dictionary"][()],
            config=DictLearnConfig(**known),
            iterations=int(file.attrs["iterations"]),
            samples=int(file.attrs["samples"]),
            features=int(file.attrs["features"]),
            data=str(file.attrs["data"]),
            stop_reason=str(file.attrs["stop_reason"]),
            world_size=int(file.attrs["world_size"]),
            metrics={name: group[name][()] for name in METRICS if name in group},
            rows_end=group["iteration"][()],
            atom_usage=group["atom_usage"][()],
            planted=file["planted_dictionary"][()] if "planted_dictionary" in file else None,
            recovery_rate=float(file.attrs["recovery_rate"]) if "recovery_rate" in file.attrs else None,
            patch_shape=tuple(int(n) for n in file.attrs["patch_shape"]) if "patch_shape" in file.attrs else None,
        )


def summarize(path: str) -> str:
    """A short text report of a results file."""
    with open_file(path, (RESULTS_FORMAT,)) as file:
        config = json.loads(file.attrs["config"])
        metrics = {name: file["metrics"][name][()] for name in METRICS if name in file["metrics"]}
        atoms, features = file["dictionary"].shape
        lines = [
            f"{path}: {atoms} atoms of {features} features, learned by {config['method']} with {config['coder']} "
            f"on {counted(int(file.attrs['world_size']), 'rank')} ({', '.join(json.loads(file.attrs['hosts']))}), "
            f"mpiscale {file.attrs['mpiscale_version']}, {file.attrs['created']}",
            f"data: {file.attrs['data']} ({file.attrs['samples']} signals); device {file.attrs['device']}; "
            f"stopped by {file.attrs['stop_reason']}",
        ]
        iterations = int(file.attrs["iterations"])
        if iterations:
            compute = metrics["compute_s"].sum() + metrics["update_s"].sum()
            communication = metrics["comm_s"].sum()
            busy = compute + communication + metrics["read_s"].sum()
            lines += [
                f"iterations: {iterations}; training time {metrics['time_s'][-1]:.2f} s",
                f"last {_row_span(file)}: objective {metrics['objective'][-1]:.4e}, error {metrics['error'][-1]:.4f}, "
                f"non-zeros {metrics['sparsity'][-1]:.2f}, unused atoms {int(metrics['unused'][-1])}",
                f"time shares: compute {compute / busy:.1%}, communication {communication / busy:.1%}, "
                f"reading {metrics['read_s'].sum() / busy:.1%}",
                f"atoms replaced in all: {int(metrics['replaced'].sum())}",
            ]
            evaluated = metrics["full_error"][~np.isnan(metrics["full_error"])]
            if len(evaluated):
                lines.append(f"whole-data error: {evaluated[-1]:.4f} (evaluated {len(evaluated)} times)")
        if "recovery_rate" in file.attrs:
            lines.append(f"planted atoms recovered (|cos| > 0.99): {file.attrs['recovery_rate']:.1%}")
        threshold = float(config.get("duplicate_cosine", 0.99))
        pairs, closest = close_pairs(file["dictionary"][()], threshold)
        lines.append(f"atoms closer than |cos| {threshold:g}: {pairs} pairs (the closest two at {closest:.3f})")
    return "\n".join(lines)


def plot(path: str, image: str) -> None:
    """The run in three panels (see ``figure``), saved to ``image``."""
    import matplotlib.pyplot as plt

    drawn = figure(path)
    drawn.savefig(image, dpi=120)
    plt.close(drawn)


def figure(path: str):
    """The run in three panels: the errors over the iterations; the planted atoms recovered over the iterations and
    at the end (atom usage without planted atoms); and the learned atoms, against the planted ones recovered worst
    where there are some, or as an image grid when they are image patches."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open_file(path, (RESULTS_FORMAT,)) as file:
        metrics = {name: file["metrics"][name][()] for name in METRICS if name in file["metrics"]}
        iterations = file["metrics"]["iteration"][()]
        dictionary = file["dictionary"][()]
        planted = file["planted_dictionary"][()] if "planted_dictionary" in file else None
        final = float(file.attrs["recovery_rate"]) if "recovery_rate" in file.attrs else None
        shape = tuple(file.attrs["patch_shape"]) if "patch_shape" in file.attrs else _square(dictionary.shape[1])
    panels = 3 if planted is not None or shape is not None else 2
    drawn, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.2))
    _errors(axes[0], iterations, metrics)
    if planted is not None:
        _recovery(axes[1], iterations, metrics, final)
        _against_planted(axes[2], dictionary, planted)
    else:
        _usage(axes[1], iterations, metrics, len(dictionary))
        if shape is not None:
            axes[2].imshow(_grid(dictionary, shape), cmap="gray", interpolation="nearest")
            axes[2].set_title(f"the {len(dictionary)} learned atoms")
            axes[2].axis("off")
    drawn.suptitle(path)
    drawn.tight_layout()
    return drawn


def _errors(axis, iterations: np.ndarray, metrics: dict[str, np.ndarray]) -> None:
    axis.semilogy(iterations, metrics["error"], label="each batch")
    evaluated = ~np.isnan(metrics["full_error"])
    if evaluated.any():
        axis.semilogy(iterations[evaluated], metrics["full_error"][evaluated], "o-", label="the whole data set")
    axis.set_title("Reconstruction error")
    axis.set_xlabel("iteration")
    axis.set_ylabel("relative error ||X - CD|| / ||X||")
    axis.legend()


def _recovery(axis, iterations: np.ndarray, metrics: dict[str, np.ndarray], final: float | None) -> None:
    """The share recovered at each evaluation, and at the end (the results file keeps it without evaluations)."""
    recovered = metrics.get("recovered", np.full(len(iterations), np.nan))
    evaluated = ~np.isnan(recovered)
    if evaluated.any():
        axis.plot(iterations[evaluated], 100 * recovered[evaluated], "o-", label="during the run (--eval-every)")
    if final is not None and len(iterations):
        axis.plot([iterations[-1]], [100 * final], "*", markersize=14, label=f"at the end: {final:.0%}")
        axis.legend(loc="lower right")
    elif not evaluated.any():
        axis.text(0.5, 0.5, "not evaluated during the run\n(give --eval-every)", ha="center", transform=axis.transAxes)
    axis.set_ylim(0, 105)
    axis.set_title("Planted atoms recovered")
    axis.set_xlabel("iteration")
    axis.set_ylabel("% of planted atoms (|cosine| > 0.99)")


def _usage(axis, iterations: np.ndarray, metrics: dict[str, np.ndarray], atoms: int) -> None:
    """Atoms unused by each batch (%, left axis) and atoms replaced so far (a count, right axis)."""
    unused = axis.plot(iterations, 100 * metrics["unused"] / atoms, label="unused by the batch (%, left)")
    axis.set_ylabel("% of the atoms unused by the batch")
    count = axis.twinx()
    replaced = count.plot(iterations, np.cumsum(metrics["replaced"]), color="C1", label="replaced so far (right)")
    count.set_ylabel("atoms replaced so far")
    axis.set_title("Atom usage")
    axis.set_xlabel("iteration")
    axis.legend(unused + replaced, [line.get_label() for line in unused + replaced], loc="upper right")


def _against_planted(axis, learned: np.ndarray, planted: np.ndarray, shown: int = 6) -> None:
    """The ``shown`` planted atoms recovered worst (solid; the missed ones first), each with the learned atom closest
    to it (dashed, its sign matched), stacked one above the other, with their |cosine|."""
    unit = planted / np.linalg.norm(planted, axis=1, keepdims=True)
    norms = np.linalg.norm(learned, axis=1, keepdims=True)
    found = learned / np.where(norms > 0, norms, 1.0)
    cosines = unit @ found.T
    best = np.argmax(np.abs(cosines), axis=1)
    closeness = np.abs(cosines[np.arange(len(unit)), best])
    worst = np.argsort(closeness, kind="stable")[:shown]
    height = max(np.abs(unit[worst]).max(), 1e-12)
    for row, atom in enumerate(worst):
        match = found[best[atom]] * np.sign(cosines[atom, best[atom]])
        offset = -1.2 * row * height
        axis.plot(unit[atom] + offset, color=f"C{row}")
        axis.plot(match + offset, "--", color=f"C{row}")
        axis.text(len(unit[atom]) - 1, offset + 0.1, f"planted {atom}: |cos| {closeness[atom]:.3f}", ha="right",
                  fontsize=8)  # fmt: skip
    missed = int(np.count_nonzero(closeness <= 0.99))
    axis.set_title(f"The {len(worst)} planted atoms recovered worst (solid) and the closest learned ones (dashed); "
                   f"{missed} of {len(unit)} missed (|cos| <= 0.99)")  # fmt: skip
    axis.title.set_fontsize(9)
    axis.set_xlabel("feature")
    axis.set_yticks([])


def _row_span(file) -> str:
    every = int(file["metrics"].attrs["every"])
    return "iteration" if every == 1 else f"{every} iterations (means)"


def _square(features: int) -> tuple[int, int] | None:
    side = math.isqrt(features)
    return (side, side) if side * side == features and side > 1 else None


def _grid(dictionary: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Atoms as tiles (each scaled to its own range) with a one-pixel border: grey, or colour for atoms of
    (H, W, C) or (C, H, W) with 3 or 4 channels (shown as RGB; where both read, 3 channels before 4, last before
    first)."""
    channels_first = len(shape) == 3 and (shape[0] == 3 and shape[2] != 3 or shape[0] == 4 and shape[2] not in (3, 4))
    height, width = (shape[1], shape[2]) if channels_first else (shape[0], shape[1])
    colour = (3,) if len(shape) == 3 else ()
    columns = math.ceil(math.sqrt(len(dictionary)))
    rows = math.ceil(len(dictionary) / columns)
    canvas = np.ones((rows * (height + 1) + 1, columns * (width + 1) + 1, *colour))
    for index, atom in enumerate(dictionary):
        tile = atom[: math.prod(shape)].reshape(shape)
        tile = (np.moveaxis(tile, 0, -1) if channels_first else tile)[..., :3] if colour else tile
        span = tile.max() - tile.min()
        tile = (tile - tile.min()) / span if span > 0 else np.zeros_like(tile)
        r, c = divmod(index, columns)
        canvas[1 + r * (height + 1) : (r + 1) * (height + 1), 1 + c * (width + 1) : (c + 1) * (width + 1)] = tile
    return canvas
