"""What a resumed ``mpiscale collect`` checks of the file an earlier run kept (``OUT.partial`` stopped, ``OUT.tmp``
killed or failed): the same settings, the same model's weights and the same input rows as those it collected.

The file marks after each round how many rows from the first are complete
(``rows_done``) and a sum of those rows' values (``io.Fingerprint``, which any
split of the rows among ranks gives alike, kept as ``data_sum``). A resumed
run reads those rows again and compares: a model trained again, or inputs
written again, under the same names would mix other rows into the file
without a word.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import torch

from ..io import DataFileError, Fingerprint, Ragged, RaggedDataset, ShardedDataset, refuse_unreadable
from ..jobs import earlier_output, kept_file, setting_differences
from ..ranks import Comm, rank_rows
from .config import CollectConfig

ACTIVATIONS_FORMAT = "mpiscale.activations/1"
#: Settings a resumed run must share with the run whose rows it keeps (the batch sizes and the device may change).
KEPT_SETTINGS = ("model", "data", "labels", "offsets", "layers")
_ROWS_AT_ONCE = 4096  # rows read at once to check the kept rows' sum


def model_digest(model: torch.nn.Module) -> str:
    """A digest of the model's parameters and buffers, by name, to the bit."""
    digest = hashlib.blake2b(digest_size=12)
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def rows_sum(fingerprint: Fingerprint, first: int, rows: np.ndarray | Ragged, token_starts: np.ndarray | None) -> None:
    """Add ``rows`` as the data set holds them (the first of them row ``first``) to ``fingerprint``: their values,
    and for token sequences (``token_starts``: each sequence's first token among all) their lengths too."""
    if isinstance(rows, Ragged):
        assert token_starts is not None, "sequences are summed at their tokens' places"
        fingerprint.add(int(token_starts[first]), rows.values.reshape(-1, 1))
        fingerprint.add(first, rows.lengths.reshape(-1, 1))
    elif len(rows):
        fingerprint.add(first, rows.reshape(len(rows), -1))


def earlier_run(config: CollectConfig, samples: int, digest: str) -> tuple[str | None, int, int]:
    """(the earlier run's file or None, the rows it collected, their values' sum) on rank 0; refuses a file that
    cannot be resumed, a run without ``--resume``, and other settings, model weights (``digest``: the model's now)
    or number of input rows."""
    kept = earlier_output(config.out)
    if kept is None:
        return None, 0, 0
    with kept_file(kept, ACTIVATIONS_FORMAT, "rows_done") as file:
        stored = json.loads(file.attrs["config"])
        done, total = int(file.attrs["rows_done"]), int(file.attrs["data_sum"])
        then = {"model weights": str(file.attrs["model_digest"]), "input rows": len(file["sample_ids"])}
    if not config.resume:
        raise ValueError(f"{kept} holds {done:,} collected rows of an earlier run: pass --resume to finish it (on any "
                         "number of ranks), or remove it to start over")  # fmt: skip
    now = json.loads(json.dumps(config.to_dict()))  # (as the file keeps them: lists, not tuples)
    changed = setting_differences(stored, {key: now[key] for key in KEPT_SETTINGS}, "stopped run")
    changed += setting_differences(then, {"model weights": digest, "input rows": samples}, "stopped run")
    if changed:
        raise ValueError(f"{kept} cannot be resumed with other settings or inputs ({'; '.join(changed)}): run it as "
                         "it was, or remove it to start over")  # fmt: skip
    return kept, done, total


def check_kept_rows(
    data: ShardedDataset | RaggedDataset, done: int, total: int, comm: Comm, token_starts: np.ndarray | None, spec: str
) -> None:
    """Refuse, on every rank, input rows ``0:done`` whose values no longer give the sum ``total`` the earlier run
    kept (collective: each rank reads its block of them, alone)."""
    fingerprint, unreadable = Fingerprint(), None
    start, stop = rank_rows(done, comm.Get_size(), comm.Get_rank())
    for lo in range(start, stop, _ROWS_AT_ONCE):
        hi = min(lo + _ROWS_AT_ONCE, stop)
        try:
            rows = data.read(np.arange(lo, hi)) if isinstance(data, RaggedDataset) else np.asarray(data.read(lo, hi))
        except DataFileError as error:
            unreadable = (lo, error)
            break
        rows_sum(fingerprint, lo, rows, token_starts)
    refuse_unreadable(comm, unreadable)
    if sum(comm.allgather(fingerprint.total)) % 2**64 != total:
        raise DataFileError(spec, (
            f"the first {done:,} rows, which the earlier run collected, hold other values now (written again, or "
            "replaced): run with the inputs it read, or remove its file to start over"
        ))  # fmt: skip
