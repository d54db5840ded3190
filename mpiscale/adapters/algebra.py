"""Where compress-adapters' products and eigensolvers run: numpy on the host, or torch on a device.

The components (:mod:`.pca`) need a handful of operations: put a batch of
rows where the products run, sum a matrix over the ranks, a QR factor, the
top eigenpairs of a symmetric matrix, and results back on the host. Two
implementations give them:

- ``HostAlgebra``: numpy and LAPACK. For a fixed number of components k that
  is small against the matrix, a Lanczos solver (ARPACK) finds only the top k
  eigenpairs to full precision: 5-10x faster than LAPACK's subset solver on
  adapters, whose leading eigenvalues stand apart, and no slower where they do
  not. It falls back on LAPACK when the solver does not converge.
- ``TorchAlgebra``: the same on a torch device (``cuda:K``, or ``cpu``: the
  twin the tests compare with the host's), through ``torch.linalg.eigh``.
  Batches of rows go to the device as they are read; a matrix is summed over
  the ranks from device memory when the MPI library takes device buffers,
  else through a pinned host copy. In ``float32`` the eigensolver runs in
  single precision and one Rayleigh-Ritz step in double precision refines the
  top k (consumer GPUs have little float64 arithmetic). The refined pairs are
  checked by their float64 residuals ``|A v - l v|``: on a flat spectrum one
  step gains almost nothing, and where a residual exceeds ``RESIDUAL_TOLERANCE``
  of the largest eigenvalue the matrix is solved again in float64.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..ranks import Comm

PRECISIONS = ("float64", "float32")
#: The Lanczos solver is used for k at most this share of the matrix's order (else LAPACK's subset solver).
LANCZOS_SHARE = 0.25
#: The largest float64 residual |A v - l v| of a refined float32 eigenpair, as a share of the largest eigenvalue,
#: kept without solving again in float64: an eigenvalue is then off by at most this share of the largest. Refined
#: pairs of adapters measured 3e-10 to 8e-8 (a shared subspace clear of its noise, and drowned in it); a flat
#: spectrum (1 to 1 + 1e-4) 9e-7, which float32 cannot resolve (2026-11-28).
RESIDUAL_TOLERANCE = 1e-7


class HostAlgebra:
    """numpy on the host (see the module docstring)."""

    device = "cpu"

    def put(self, rows: np.ndarray) -> Any:
        return np.asarray(rows, dtype=np.float64)

    def zeros(self, shape: tuple[int, ...]) -> Any:
        return np.zeros(shape)

    def host(self, matrix: Any) -> np.ndarray:
        return matrix

    def qr(self, matrix: Any) -> Any:
        return np.linalg.qr(matrix)[0]

    def eigenvalues(self, matrix: Any) -> np.ndarray:
        return np.linalg.eigvalsh(matrix)

    def trace(self, matrix: Any) -> float:
        return float(np.trace(matrix))

    def sum_over_ranks(self, matrix: Any, comm: Comm) -> Any:
        from mpi4py import MPI

        comm.Allreduce(MPI.IN_PLACE, matrix)
        return matrix

    def top_eigenpairs(self, matrix: Any, wanted: int = 0) -> tuple[np.ndarray, Any]:
        """The eigenvalues of a symmetric ``matrix``, largest first, and their vectors (columns): the ``wanted``
        largest only when that is fewer than all, else all of them."""
        size = len(matrix)
        if 0 < wanted <= LANCZOS_SHARE * size:
            from scipy.sparse.linalg import ArpackNoConvergence, eigsh

            start = np.random.default_rng(size).standard_normal(size)  # fixed: the same answer on every run
            try:
                values, vectors = eigsh(matrix, k=wanted, which="LA", tol=0, v0=start)
            except ArpackNoConvergence:
                pass
            else:
                order = np.argsort(values)[::-1]
                return values[order], vectors[:, order]
        if 0 < wanted < size:
            from scipy.linalg import eigh

            values, vectors = eigh(matrix, subset_by_index=[size - wanted, size - 1], driver="evr", check_finite=False)
        else:
            values, vectors = np.linalg.eigh(matrix)
        return values[::-1], vectors[:, ::-1]


class TorchAlgebra:
    """torch on ``device`` (see the module docstring)."""

    def __init__(self, device: str, precision: str = "float64", cuda_aware: bool = False) -> None:
        import torch

        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        self.torch, self.device, self.precision, self.cuda_aware = torch, device, precision, cuda_aware
        #: How many float32 solves failed the residual check and were solved again in float64.
        self.solved_again = 0

    def put(self, rows: np.ndarray) -> Any:
        return self.torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float64)).to(self.device)

    def zeros(self, shape: tuple[int, ...]) -> Any:
        return self.torch.zeros(shape, dtype=self.torch.float64, device=self.device)

    def host(self, matrix: Any) -> np.ndarray:
        return matrix.cpu().numpy()

    def qr(self, matrix: Any) -> Any:
        return self.torch.linalg.qr(matrix)[0]

    def eigenvalues(self, matrix: Any) -> np.ndarray:
        return self.host(self.torch.linalg.eigvalsh(matrix))

    def trace(self, matrix: Any) -> float:
        return float(self.torch.trace(matrix))

    def sum_over_ranks(self, matrix: Any, comm: Comm) -> Any:
        from mpi4py import MPI

        if comm.Get_size() == 1:
            return matrix
        if matrix.device.type == "cpu":
            comm.Allreduce(MPI.IN_PLACE, matrix.numpy())
            return matrix
        if self.cuda_aware:  # device memory straight to the MPI library
            self.torch.cuda.current_stream().synchronize()
            comm.Allreduce(MPI.IN_PLACE, matrix)
            return matrix
        staged = self.torch.empty(matrix.shape, dtype=matrix.dtype, pin_memory=True)
        staged.copy_(matrix)  # synchronous: the products that made it are done
        comm.Allreduce(MPI.IN_PLACE, staged.numpy())
        return matrix.copy_(staged, non_blocking=True)

    def top_eigenpairs(self, matrix: Any, wanted: int = 0) -> tuple[np.ndarray, Any]:
        """As ``HostAlgebra.top_eigenpairs``, by ``torch.linalg.eigh`` (all pairs, then the top ``wanted``)."""
        torch = self.torch
        if self.precision == "float32" and 0 < wanted < len(matrix):
            rough = torch.linalg.eigh(matrix.to(torch.float32))[1][:, -wanted:].to(torch.float64)
            basis = torch.linalg.qr(matrix @ rough)[0]  # one step of subspace iteration, in float64
            values, rotation = torch.linalg.eigh(basis.T @ matrix @ basis)  # Rayleigh-Ritz
            vectors = basis @ rotation
            residuals = torch.linalg.vector_norm(matrix @ vectors - vectors * values, dim=0)
            if float(residuals.max()) <= RESIDUAL_TOLERANCE * float(values.abs().max()):
                return self.host(values.flip(0)), vectors.flip(1)
            self.solved_again += 1
        values, vectors = torch.linalg.eigh(matrix)
        if 0 < wanted < len(matrix):
            values, vectors = values[-wanted:], vectors[:, -wanted:]
        return self.host(values.flip(0)), vectors.flip(1)


Algebra = HostAlgebra | TorchAlgebra
