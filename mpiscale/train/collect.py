"""The activation-collection job (``mpiscale collect``): a trained model's layer outputs for a whole data set.

Every rank runs its block of the input rows through the model, a block of
``batch_size`` rows at a time, and forward hooks on the named modules capture
their outputs. Each round every rank writes its rows straight into one HDF5
file (``RowWriter``, collective), so nothing is gathered into one process and
a rank's memory is one round's rows whatever the data size. The file holds one
data set per layer (rows in input order) and ``sample_ids`` (the rows' numbers
in the input data set), with ``inputs``, ``labels`` and ``model`` attributes
naming where they came from: ``mpiscale dictlearn --data FILE:/LAYER`` learns
from it, and ``mpiscale inspect`` shows which inputs activate each atom.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from ..io import (
    DataFileError,
    OutputLock,
    Ragged,
    RaggedDataset,
    RowWriter,
    ShardedDataset,
    length_batches,
    recorded,
    split_spec,
)
from ..jobs import ProgressLine, choose_torch_device, claim_outputs, recorded_devices, run_without_steps
from ..kernels.threads import share_cores
from ..ranks import AgreedError, Comm, rank_rows, ranks_sharing_cores, run_agreed
from ..runtime import ActorSystem
from .config import CollectConfig
from .encoder import PAD
from .model import first_bad_row, input_layout, layer_outputs, model_rows, module_names, rows_refused
from .results import load_trained

ACTIVATIONS_FORMAT = "mpiscale.activations/1"

log = logging.getLogger(__name__)


class _BadRows(AgreedError):
    """Some rank's rows of a round hold values the model cannot take: bad input (status 2), found as they are read."""


@dataclass
class _Job:
    comm: Comm
    model: torch.nn.Module
    device: str  # where the model runs: "cpu", "cuda:K"
    path: str
    name: str
    samples: int
    features: int  # numbers per input row
    dtype: np.dtype  # the numpy type the model takes them as
    spec: dict  # the model's shape, as its results file gives it
    widths: dict[str, int]
    attrs: dict
    lock: OutputLock | None
    offsets: str | None  # ragged data: its index (None: rows of one size)
    tokens: int = 0  # ragged data: the most padded tokens run through the model at once


async def collect(system: ActorSystem, config: CollectConfig) -> dict:
    """Run the job on every rank; bad input ends it before any row is read, with one message and status 2."""
    return await run_without_steps(system, "collect", lambda: _prepare(config),
                                   lambda job: _write(system, config, job), _BadRows)  # fmt: skip


def _prepare(config: CollectConfig) -> _Job:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    torch.set_num_threads(share_cores(ranks_sharing_cores(comm)))
    device = choose_torch_device(config.device, comm)
    model, trained = load_trained(config.model)
    model.to(device)
    known = module_names(model)
    unknown = [name for name in config.layer_names if name not in known]
    if unknown:
        raise ValueError(f"{config.model} has no module {', '.join(unknown)}; its modules: {', '.join(known)}")
    path, name = split_spec(config.data or str(trained["data"]))
    if not config.data and not os.path.isabs(path) and not glob.glob(path):
        raise DataFileError(config.model, (
            f"names its training data {path}, a path relative to where training ran, which is not found from "
            f"{os.getcwd()}: pass --data FILE:/dataset"
        ))  # fmt: skip
    spec = json.loads(trained["model"])
    inputs, model_dtype = input_layout(spec)
    offsets, tokens = None, 0
    if spec.get("ragged"):
        training = json.loads(trained["config"])
        offsets = config.offsets or (training.get("offsets", "") if not config.data else "")
        tokens = config.batch_tokens or _training_tokens(training, spec)
        name, samples = _check_ragged(path, name, offsets, comm, config.layer_names, known, spec, tokens)
        inputs = 1  # a sequence of one token sizes the layers
    else:
        with ShardedDataset(path, name, comm) as data:
            name, shape, dtype, matlab = data.name, data.shape, data.dtype, data.matlab_note("samples")
        features = int(np.prod(shape[1:])) if len(shape) > 1 else 0
        taken = rows_refused(inputs, model_dtype, features, dtype)
        if taken is not None:
            held = f"the data set holds {dtype} {shape}" + (f" ({matlab})" if matlab else "")
            raise DataFileError(path, f"the model takes rows of {taken}, {held}", name)
        if matlab and comm.Get_rank() == 0:
            log.warning(matlab)
        samples = shape[0]
    labels = config.labels or (str(trained["labels"]) if not config.data else "")
    attrs = recorded("inputs", f"{path}:/{name}", config.out) | recorded("model", config.model, config.out)
    attrs |= recorded("labels", labels, config.out) if labels else {"labels": ""}
    if "image_shape" in trained:
        attrs["image_shape"] = trained["image_shape"]
    attrs["device"] = recorded_devices(device, comm)
    lock = claim_outputs(config.out, None, [config.model, path], comm, ACTIVATIONS_FORMAT)
    widths = _widths(model, config.layer_names, inputs, model_dtype, device)
    return _Job(comm, model, device, path, name, samples, inputs, model_dtype, spec, widths, attrs, lock, offsets,
                tokens)  # fmt: skip


def _training_tokens(training: dict, spec: dict) -> int:
    """The padded tokens a batch of the model's training held at most: its token budget, or its batch of its
    longest sequences."""
    if training.get("batching") == "memory" and training.get("batch_tokens"):
        return int(training["batch_tokens"])
    return int(training.get("batch_size", 64)) * int(spec["length"])


def _check_ragged(
    path: str, name: str, offsets: str, comm: Comm, layers: list[str], known: list[str], spec: dict, tokens: int
) -> tuple[str, int]:
    """(data set name, sequences) of ragged token data for a ragged model, whose per-token layers are refused: a
    row per sequence needs one width (the layers from ``pool`` on). A sequence longer than the model's positions,
    or than ``tokens`` (one batch), is refused before any is run."""
    per_token = known[: known.index("pool")] if "pool" in known else []
    refused = [layer for layer in layers if layer in per_token]
    if refused:
        raise ValueError(
            f"{', '.join(refused)}: a model of sequences of varying length has outputs per token there, of varying "
            f"length; collect takes one row per sequence: {', '.join(known[len(per_token) :])}"
        )
    with RaggedDataset(path, name, offsets, comm) as data:
        if data.dtype.kind not in "biu" or data.row_shape:
            raise DataFileError(path, f"the model takes token ids, the data set holds {data.dtype} values", data.name)
        longest = int(np.argmax(data.lengths)) if len(data) else 0
        length = int(data.lengths[longest]) if len(data) else 0
        if length > spec["length"]:
            raise DataFileError(path, (
                f"sample {longest} holds {length:,} tokens, more than the model's {spec['length']:,} positions (its "
                "longest training sequence): cut the sequences, or train on sequences as long"
            ), data.name)  # fmt: skip
        if length > tokens:
            raise DataFileError(path, (
                f"sample {longest} holds {length:,} tokens, more than batch_tokens ({tokens:,}) lets a batch hold: "
                f"raise --batch-tokens to at least {length:,}"
            ), data.name)  # fmt: skip
        return data.name, len(data)


def _widths(model: torch.nn.Module, layers: list[str], inputs: int, dtype: np.dtype, device: str) -> dict[str, int]:
    """Each layer's output width, from one row of zeros."""
    captured = layer_outputs(model, layers, torch.from_numpy(np.zeros((1, inputs), dtype)).to(device))
    return {name: captured[name].shape[1] for name in layers}


def _write(system: ActorSystem, config: CollectConfig, job: _Job) -> dict:
    comm, size, rank = job.comm, system.size, system.rank
    layout: dict[str, tuple[tuple[int, ...], np.dtype]] = {
        name: ((job.samples, width), np.dtype(np.float32)) for name, width in job.widths.items()
    }
    layout["sample_ids"] = ((job.samples,), np.dtype(np.int64))
    start, stop = rank_rows(job.samples, size, rank)
    largest = -(-job.samples // size)
    rounds = max(1, -(-largest // config.batch_size))  # the largest block's rounds: the same on every rank
    progress = ProgressLine(rounds, 0, config.progress_every if rank == 0 else None, "rows", "round")
    with (
        _open_inputs(job, comm) as data,
        RowWriter(config.out, layout, comm, config.to_dict(), job.attrs, ACTIVATIONS_FORMAT) as writer,
    ):
        for index in range(rounds):
            lo = min(start + index * config.batch_size, stop)
            hi = min(lo + config.batch_size, stop)
            read: list[np.ndarray | Ragged] = []
            # agreed: rows one rank cannot read (a damaged chunk) must not leave the others waiting in the next round
            run_agreed(comm, f"round {index + 1}", partial(_read_checked, job, data, lo, hi, read), _BadRows)
            rows = read[0]
            captured: dict[str, np.ndarray] = {}
            # agreed: a failure on one rank must not leave the others waiting in the collective write
            run_agreed(comm, f"round {index + 1}: the model on rows {lo}-{hi}", partial(_capture, job, rows, captured))
            writer.write(lo, captured | {"sample_ids": np.arange(lo, hi, dtype=np.int64)})
            progress.update(index + 1, f"{hi - start:,} of {stop - start:,} rows on rank 0", (hi - lo) * size)
    progress.finish()
    if rank == 0:
        layers = ", ".join(f"/{name} ({job.samples} x {width})" for name, width in job.widths.items())
        print(f"wrote {config.out}: {layers} from {job.attrs['inputs']}", flush=True)
    return {"samples": job.samples, "widths": job.widths}


def _open_inputs(job: _Job, comm: Comm) -> ShardedDataset | RaggedDataset:
    if job.offsets is None:
        return ShardedDataset(job.path, job.name, comm)
    return RaggedDataset(job.path, job.name, job.offsets, comm)


def _rows(job: _Job, data: ShardedDataset | RaggedDataset, lo: int, hi: int) -> np.ndarray | Ragged:
    """Rows ``lo:hi`` as the model takes them (collective for rows of one size; sequences packed)."""
    if isinstance(data, RaggedDataset):
        return data.read(np.arange(lo, hi))
    return model_rows(np.asarray(data.read_collective(lo, hi)), job.dtype).reshape(hi - lo, job.features)


def _read_checked(job: _Job, data: ShardedDataset | RaggedDataset, lo: int, hi: int, out: list) -> None:
    """Rows ``lo:hi`` read into ``out``, refused when they cannot be read or the model cannot take them."""
    rows = _rows(job, data, lo, hi)
    _check_rows(job, rows, lo)
    out.append(rows)


def _check_rows(job: _Job, rows: np.ndarray | Ragged, first: int) -> None:
    """Refuse rows the model cannot take (NaN or infinity, token ids it does not know); ``first`` is the first row's
    number."""
    if isinstance(rows, Ragged):  # each token as a row, then the sequence that holds it
        bad = first_bad_row(job.spec, rows.values.reshape(-1, 1))
        if bad is not None:
            bad = int(np.searchsorted(rows.offsets, bad[0], side="right")) - 1, bad[1]
    else:
        bad = first_bad_row(job.spec, rows)
    if bad is not None:
        raise DataFileError(job.path, f"sample {first + bad[0]} {bad[1]}", job.name)


def _capture(job: _Job, rows: np.ndarray | Ragged, into: dict[str, np.ndarray]) -> None:
    """The layers' outputs for ``rows`` (none: empty arrays of the layers' widths) into ``into``; sequences run in
    batches of at most ``job.tokens`` padded tokens, grouped by length."""
    if not len(rows):
        into.update(_empty(job.widths))
        return
    if not isinstance(rows, Ragged):
        into.update(layer_outputs(job.model, list(job.widths), torch.from_numpy(rows).to(job.device)))
        return
    into.update({name: np.empty((len(rows), width), np.float32) for name, width in job.widths.items()})
    for batch in length_batches(rows.lengths, job.tokens):
        padded = rows.take(batch).padded(PAD).astype(job.dtype, copy=False)
        for name, values in layer_outputs(job.model, list(job.widths), torch.from_numpy(padded).to(job.device)).items():
            into[name][batch] = values


def _empty(widths: dict[str, int]) -> dict[str, np.ndarray]:
    return {name: np.empty((0, width), np.float32) for name, width in widths.items()}
