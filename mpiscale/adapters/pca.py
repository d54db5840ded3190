"""Shared components of rows spread over the ranks: exact, or by a randomized range finder, always in float64.

Each rank has some rows (the rows of its adapters' A matrices of one layer
group, or of their B matrices transposed), read a block at a time. The components are the top
eigenvectors of the rows' second-moment matrix ``X^T X``, a sum over rows and
so over ranks: an allreduce makes it exact whatever the number of adapters
(no chunked "meta-PCA"). The rows are not centred: an adapter is rebuilt as a
projection of its own matrices on the components, with nothing added.

- ``exact``: the d x d matrix summed over the ranks and solved with ``eigh``;
  when there are fewer rows than d, the rows themselves are gathered and the
  smaller Gram matrix is solved instead (the same components). With a fixed
  number of components only their eigenpairs are computed (see :mod:`.algebra`).
- ``randomized`` (Halko, Martinsson and Tropp): a random d x (k + p) block,
  ``power_iterations`` passes of multiplying by ``X^T X`` (each one allreduce
  of d x (k + p)), then the small (k + p) x (k + p) problem. For many rows
  and a small k. With ``power_iterations`` 0 the passes go on until one adds
  less than ``CONVERGED`` of what the best k directions of the block capture
  (their Ritz values, free from the pass's own product): two passes capture
  0.4-3% less than exact on rows without a strong shared subspace (trained
  adapters), where a planted one is found in two.

The products and eigensolvers run where the ``algebra`` puts them (:mod:`.algebra`: numpy on the host, or torch
on a GPU); row blocks are batched on the host and go to the device a batch at a time. Each component's sign is
fixed (its largest entry positive), so that solvers and devices give the same vectors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..ranks import Comm
from .algebra import Algebra, HostAlgebra

METHODS = ("exact", "randomized")
CONVERGED = 1e-5  # randomized, automatic passes: a pass that adds less than this share of the captured sum ends them
MOST_PASSES = 30


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


Rows = Callable[[], Iterable[np.ndarray]]  # every call yields this rank's row blocks anew (re-read, not kept)

#: Row blocks are gathered up to this many bytes before a product: one adapter's 16 rows against a d x d matrix
#: would stream the whole matrix through memory for very little arithmetic.
BATCH_BYTES = 32 << 20


def batched(rows: Rows, dimension: int) -> Iterator[np.ndarray]:
    """The blocks of ``rows()`` stacked into batches of at most ``BATCH_BYTES`` (or one block, if larger)."""
    limit = max(1, BATCH_BYTES // (8 * dimension))
    pending: list[np.ndarray] = []
    held = 0
    for block in rows():
        pending.append(block)
        held += len(block)
        if held >= limit:
            yield np.concatenate(pending)
            pending, held = [], 0
    if pending:
        yield np.concatenate(pending)


def shared_components(
    rows: Rows,
    count: int,
    dimension: int,
    comm: Comm,
    method: str,
    components: int,
    variance: float,
    oversampling: int = 10,
    power_iterations: int = 2,
    seed: int = 0,
    unseen: float = 0.0,
    most: int = 0,
    algebra: Algebra | None = None,
) -> Components:
    """The components of every rank's rows (collective; ``count`` rows of ``dimension`` numbers on all the ranks
    together): ``components`` of them, or (0) the fewest that explain ``variance`` of the total, at most ``most``
    (0: no cap); never more than the rows' numerical rank. ``unseen``: a sum of squares of rows not given (what an
    earlier compression left out of the rows it gives), counted in the total the components' shares are of.

    ``rows()`` is called once per pass over the rows, so a rank holds one block at a time: memory is d x d (or
    d x (k + p)) whatever the number of rows, except on the Gram path, whose rows (fewer than d) are gathered.
    ``algebra``: where the products run (the host's numpy by default).
    """
    algebra = algebra or HostAlgebra()
    if method == "randomized":
        width = min(components + oversampling, dimension, count)
        values, vectors, total = _randomized(rows, dimension, comm, width, power_iterations, seed, components, algebra)
    elif count >= dimension:
        values, vectors, total = _covariance(rows, dimension, comm, components, algebra)
    else:
        values, vectors, total = _gram(rows, dimension, comm, components, algebra)
    total += unseen
    tiny = max(values[0], 0.0) * dimension * np.finfo(np.float64).eps if len(values) else 0.0
    kept = int(np.count_nonzero(values > tiny))
    if components:
        kept = min(components, kept)
    else:
        reached = np.cumsum(values[:kept]) >= variance * total
        kept = int(np.argmax(reached)) + 1 if reached.any() else kept
        kept = min(kept, most) if most else kept
    found = Components(_signed(algebra.host(vectors(kept))), values[:kept].copy(), total)
    return comm.bcast(found, root=0)  # rank 0's, to the bit, wherever the ranks' rounding differed


def _signed(vectors: np.ndarray) -> np.ndarray:
    """The rows of ``vectors`` (contiguous), each turned so that its entry of largest magnitude is positive."""
    largest = vectors[np.arange(len(vectors)), np.argmax(np.abs(vectors), axis=1)] if vectors.size else vectors[:, 0]
    return np.ascontiguousarray(vectors * np.where(largest < 0, -1.0, 1.0)[:, None])


Solved = tuple[np.ndarray, Callable[[int], Any], float]  # eigenvalues (host), the top kept vectors, the total


def _covariance(rows: Rows, dimension: int, comm: Comm, wanted: int, algebra: Algebra) -> Solved:
    moment = algebra.zeros((dimension, dimension))
    for block in batched(rows, dimension):
        on_device = algebra.put(block)
        moment += on_device.T @ on_device
    moment = algebra.sum_over_ranks(moment, comm)
    values, vectors = algebra.top_eigenpairs(moment, wanted)
    return values, lambda kept: vectors[:, :kept].T, algebra.trace(moment)


def _gram(rows: Rows, dimension: int, comm: Comm, wanted: int, algebra: Algebra) -> Solved:
    """Fewer rows than dimensions: every rank takes all the rows and solves their Gram matrix."""
    mine = list(rows())
    local = np.ascontiguousarray(np.concatenate(mine) if mine else np.empty((0, dimension)), dtype=np.float64)
    counts = comm.allgather(local.size)
    everyone = np.empty((sum(counts) // dimension, dimension))
    comm.Allgatherv(local, [everyone, counts])  # raw buffers, rank order: no pickling of the rows
    stacked = algebra.put(everyone)
    gram = stacked @ stacked.T
    values, left = algebra.top_eigenpairs(gram, wanted)

    def vectors(kept: int) -> Any:  # only the kept ones: each costs a pass over the rows
        return (left[:, :kept].T @ stacked) / algebra.put(np.sqrt(values[:kept])[:, None])

    return values, vectors, algebra.trace(gram)


def _randomized(
    rows: Rows, dimension: int, comm: Comm, width: int, power_iterations: int, seed: int, components: int,
    algebra: Algebra,
) -> Solved:  # fmt: skip
    """The range finder; ``power_iterations`` 0: passes until converged (see the module docstring)."""
    from mpi4py import MPI

    def moment_times(block: Any) -> Any:
        product = algebra.zeros(tuple(block.shape))
        for part in batched(rows, dimension):
            on_device = algebra.put(part)
            product += on_device.T @ (on_device @ block)
        return algebra.sum_over_ranks(product, comm)

    probe = algebra.put(np.random.default_rng(seed).standard_normal((dimension, width)))  # the same on every rank
    basis = algebra.qr(moment_times(probe))
    captured = 0.0
    for _ in range(power_iterations or MOST_PASSES):
        product = moment_times(basis)
        if not power_iterations:  # the best k directions of this basis capture the top k of B^T M B
            now = float(algebra.eigenvalues(basis.T @ product)[-components:].sum())
            if comm.bcast(now - captured <= CONVERGED * abs(now), root=0):  # one decision: as many passes everywhere
                break
            captured = now
        basis = algebra.qr(product)
    small, total = algebra.zeros((width, width)), 0.0
    for part in batched(rows, dimension):
        projected = algebra.put(part) @ basis
        small += projected.T @ projected
        total += float(np.einsum("ij,ij->", part, part))
    small = algebra.sum_over_ranks(small, comm)
    total = comm.allreduce(total, op=MPI.SUM)
    values, rotation = algebra.top_eigenpairs(small)
    return values, lambda kept: (basis @ rotation[:, :kept]).T, total
