"""The codes file of ``mpiscale encode`` (``mpiscale.codes/1``): CSR sparse codes, their summary and loader.

Layout, all readable with plain h5py:

- ``/codes/data`` (non-zeros, float64), ``/codes/indices`` (each one's atom,
  int32) and ``/codes/indptr`` (signals + 1, int64): row ``i``'s codes are
  ``data[indptr[i]:indptr[i + 1]]`` at atoms ``indices[...]``, as scipy's
  ``csr_matrix((data, indices, indptr), shape=attrs["shape"])`` reads them;
- ``/residual_norm`` (signals): each signal's ``||x - c D||``;
- ``/mean`` (signals), when each signal's mean was removed before coding: the
  signal is ``mean + c D``;
- ``/dictionary`` (atoms x features): the atoms the codes refer to;
- attributes: the usual mpiscale ones (version, format, created, world size,
  config), ``shape`` ([signals, atoms]), ``data`` and ``dictionary_file`` (where
  they came from), ``sparsity``, ``remove_mean``, ``device``, and ``rows_done``
  and ``nnz_done`` (how far the file is complete; the whole of it once it has
  its final name).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import h5py
import numpy as np

from ..io import DataFileError, open_file, unfinished_run
from ..words import counted, how_to_finish

CODES_FORMAT = "mpiscale.codes/1"


def csr_rows(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(values, their atoms as int32, each row's end in them) of dense codes (signals x atoms), row by row."""
    rows, atoms = np.nonzero(codes)
    ends = np.cumsum(np.bincount(rows, minlength=len(codes)), dtype=np.int64)
    return codes[rows, atoms], atoms.astype(np.int32), ends


@dataclass(frozen=True)
class SparseCodes:
    """What a codes file holds, as ``load_codes`` reads it."""

    data: np.ndarray
    indices: np.ndarray
    indptr: np.ndarray
    shape: tuple[int, int]  # (signals, atoms)
    residual_norm: np.ndarray
    mean: np.ndarray | None  # each signal's mean, when it was removed before coding
    dictionary: np.ndarray
    config: dict

    def to_scipy(self):
        """The codes as a ``scipy.sparse.csr_matrix`` (scipy is needed for this alone)."""
        from scipy.sparse import csr_matrix

        return csr_matrix((self.data, self.indices, self.indptr), shape=self.shape)

    def dense(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Codes of signals ``start:stop`` as a dense array (signals x atoms)."""
        stop = self.shape[0] if stop is None else stop
        out = np.zeros((stop - start, self.shape[1]))
        for row in range(start, stop):
            lo, hi = self.indptr[row], self.indptr[row + 1]
            out[row - start, self.indices[lo:hi]] = self.data[lo:hi]
        return out

    def signals(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """The signals the codes rebuild (``c D``, plus each one's mean when it was removed)."""
        rebuilt = self.dense(start, stop) @ self.dictionary
        if self.mean is not None:
            rebuilt += self.mean[start:stop, None]
        return rebuilt


def load_codes(path: str) -> SparseCodes:
    """The codes of an ``mpiscale encode`` file (a stopped or killed run's is refused, saying how to finish it: its
    rows after the coded ones hold nothing)."""
    with open_file(path, (CODES_FORMAT,)) as file:
        unfinished = unfinished_run(file)
        if unfinished:
            raise DataFileError(path, unfinished)
        return _read(file, *_coded(file)[1:])


def _coded(file: h5py.File) -> tuple[int, int, int]:
    """(signals, signals coded, their non-zeros) of an open codes file: short of the whole in a stopped or killed
    run's file (``OUT.partial``, ``OUT.tmp``), whose marks say how far it is complete."""
    signals = int(file.attrs["shape"][0])
    done = int(file.attrs.get("rows_done", signals))
    return signals, done, int(file.attrs.get("nnz_done", len(file["codes/data"])))


def _read(file: h5py.File, done: int, nonzeros: int) -> SparseCodes:
    """The codes of the first ``done`` signals (``nonzeros`` values) of an open codes file."""
    return SparseCodes(
        data=file["codes/data"][:nonzeros],
        indices=file["codes/indices"][:nonzeros],
        indptr=file["codes/indptr"][: done + 1],
        shape=(done, int(file.attrs["shape"][1])),
        residual_norm=file["residual_norm"][:done],
        mean=file["mean"][:done] if "mean" in file else None,
        dictionary=file["dictionary"][()],
        config=json.loads(file.attrs["config"]),
    )


def summarize(path: str) -> str:
    """A short text report of a codes file; of a stopped or killed run's, the signals it coded and how to finish
    (its numbers over those signals)."""
    with open_file(path, (CODES_FORMAT,)) as file:
        signals, done, nonzeros = _coded(file)
        codes, attrs = _read(file, done, nonzeros), dict(file.attrs)
    atoms = codes.shape[1]
    config = codes.config
    per_signal = np.diff(codes.indptr)
    usage = np.bincount(codes.indices, minlength=atoms)
    if config["coder"] == "lasso":
        coder = f"lasso, alpha {config['alpha']:g}"
    else:
        target = f", to residual {config['max_residual']:g}" if config["max_residual"] else ""
        coder = f"omp, at most {attrs['sparsity']} atoms{target}"
    residual = codes.residual_norm
    lines = [
        f"{path}: codes of {signals:,} signals over {atoms} atoms ({coder}"
        f"{', each signal less its mean' if codes.mean is not None else ''}), on "
        f"{counted(int(attrs['world_size']), 'rank')}, mpiscale {attrs['mpiscale_version']}, {attrs['created']}",
        f"data: {attrs['data']}; dictionary: {attrs['dictionary_file']}; device {attrs['device']}",
    ]
    if done < signals:
        lines.append(f"signals: {done:,} of {signals:,} coded; {how_to_finish(path, 'encode', 'codes')}")
    over = "" if done == signals else f" over the {done:,} coded"
    lines.append(
        f"non-zeros{over}: {len(codes.data):,} ({per_signal.mean():.2f} a signal; fewest {per_signal.min()}, most "
        f"{per_signal.max()})"
        if done
        else "non-zeros: none (no signals)"
    )
    if done:
        quartiles = np.percentile(residual, [50, 90, 100])
        lines.append(f"residual norm ||x - cD||{over}: median {quartiles[0]:.4g}, 90% {quartiles[1]:.4g}, largest "
                     f"{quartiles[2]:.4g}")  # fmt: skip
        lines.append(
            f"atoms used: {np.count_nonzero(usage)} of {atoms}; the most used: "
            + ", ".join(f"{atom} ({usage[atom]:,})" for atom in np.argsort(-usage, kind="stable")[:5])
        )
    return "\n".join(lines)
