"""Shared components of rows spread over the ranks: exact, or by a randomized range finder, always in float64.

Each rank holds some rows (the rows of its adapters' A matrices of one layer
group, or of their B matrices transposed). The components are the top
eigenvectors of the rows' second-moment matrix ``X^T X``, a sum over rows and
so over ranks: an allreduce makes it exact whatever the number of adapters
(no chunked "meta-PCA"). The rows are not centred: an adapter is rebuilt as a
projection of its own matrices on the components, with nothing added.

- ``exact``: the d x d matrix summed over the ranks and solved with ``eigh``;
  when there are fewer rows than d, the rows themselves are gathered and the
  smaller Gram matrix is solved instead (the same components).
- ``randomized`` (Halko, Martinsson and Tropp): a random d x (k + p) block,
  ``power_iterations`` passes of multiplying by ``X^T X`` (each one allreduce
  of d x (k + p)), then the small (k + p) x (k + p) problem. For many rows
  and a small k.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ranks import Comm

METHODS = ("exact", "randomized")


@dataclass(frozen=True)
class Components:
    """Orthonormal rows spanning the shared subspace, and what each explains."""

    vectors: np.ndarray  # k x d
    variances: np.ndarray  # k: the sum of squares along each component (descending)
    total: float  # the rows' whole sum of squares

    @property
    def explained(self) -> np.ndarray:
        """Each component's share of the total."""
        return self.variances / self.total if self.total > 0 else np.zeros_like(self.variances)


def shared_components(
    rows: np.ndarray,
    comm: Comm,
    method: str,
    components: int,
    variance: float,
    oversampling: int = 10,
    power_iterations: int = 2,
    seed: int = 0,
) -> Components:
    """The components of every rank's ``rows`` (collective): ``components`` of them, or (0) the fewest that
    explain ``variance`` of the total; never more than the rows' numerical rank."""
    from mpi4py import MPI

    rows = np.ascontiguousarray(rows, np.float64)
    dimension = rows.shape[1]
    count = comm.allreduce(len(rows), op=MPI.SUM)
    if method == "randomized":
        width = min(components + oversampling, dimension, count)
        values, vectors, total = _randomized(rows, comm, width, power_iterations, seed)
    elif count >= dimension:
        values, vectors, total = _covariance(rows, comm)
    else:
        values, vectors, total = _gram(rows, comm)
    kept = (
        int(np.count_nonzero(values > max(values[0], 0.0) * dimension * np.finfo(np.float64).eps)) if len(values) else 0
    )
    if components:
        kept = min(components, kept)
    else:
        reached = np.cumsum(values[:kept]) >= variance * total
        kept = int(np.argmax(reached)) + 1 if reached.any() else kept
    found = Components(np.ascontiguousarray(vectors[:kept]), values[:kept].copy(), total)
    return comm.bcast(found, root=0)  # rank 0's, to the bit, wherever the ranks' rounding differed


def _covariance(rows: np.ndarray, comm: Comm) -> tuple[np.ndarray, np.ndarray, float]:
    from mpi4py import MPI

    moment = rows.T @ rows
    comm.Allreduce(MPI.IN_PLACE, moment)
    values, vectors = np.linalg.eigh(moment)
    order = np.argsort(values)[::-1]
    return values[order], vectors[:, order].T, float(np.trace(moment))


def _gram(rows: np.ndarray, comm: Comm) -> tuple[np.ndarray, np.ndarray, float]:
    """Fewer rows than dimensions: every rank takes all the rows and solves their Gram matrix."""
    stacked = np.concatenate([part for part in comm.allgather(rows) if len(part)])
    gram = stacked @ stacked.T
    values, left = np.linalg.eigh(gram)
    order = np.argsort(values)[::-1]
    values, left = values[order], left[:, order]
    positive = values > 0
    vectors = np.zeros((len(values), stacked.shape[1]))
    vectors[positive] = (left[:, positive].T @ stacked) / np.sqrt(values[positive])[:, None]
    return values, vectors, float(np.trace(gram))


def _randomized(
    rows: np.ndarray, comm: Comm, width: int, power_iterations: int, seed: int
) -> tuple[np.ndarray, np.ndarray, float]:
    from mpi4py import MPI

    def moment_times(block: np.ndarray) -> np.ndarray:
        product = rows.T @ (rows @ block)
        comm.Allreduce(MPI.IN_PLACE, product)
        return product

    probe = np.random.default_rng(seed).standard_normal((rows.shape[1], width))  # the same on every rank
    basis = np.linalg.qr(moment_times(probe))[0]
    for _ in range(power_iterations):
        basis = np.linalg.qr(moment_times(basis))[0]
    projected = rows @ basis
    small = projected.T @ projected
    comm.Allreduce(MPI.IN_PLACE, small)
    values, rotation = np.linalg.eigh(small)
    order = np.argsort(values)[::-1]
    total = comm.allreduce(float(np.einsum("ij,ij->", rows, rows)), op=MPI.SUM)
    return values[order], (basis @ rotation[:, order]).T, total
