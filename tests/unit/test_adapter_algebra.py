"""Where compress-adapters' linear algebra runs: the host's Lanczos solver against LAPACK's, and torch (the twin of
the GPU path, here on the CPU) against numpy, in float64 and in float32 refined, on every path of the components."""

import numpy as np
import pytest
from mpi4py import MPI

from mpiscale.adapters.algebra import HostAlgebra, TorchAlgebra
from mpiscale.adapters.pca import shared_components

torch = pytest.importorskip("torch", reason="pip install 'mpiscale[torch]' for the torch algebra")


def adapter_rows(count: int, dimension: int, rank: int = 8, shared: int = 12, noise: float = 0.3, seed: int = 0):
    """Blocks of ``rank`` rows, one per adapter, near a shared subspace: a spread spectrum with a soft edge."""
    rng = np.random.default_rng(seed)
    basis = np.linalg.qr(rng.standard_normal((dimension, shared)))[0].T
    scales = np.linspace(3.0, 1.0, shared)
    return [(rng.standard_normal((rank, shared)) * scales) @ basis + noise * rng.standard_normal((rank, dimension))
            for _ in range(count)]  # fmt: skip


@pytest.mark.parametrize("spectrum", ["adapters", "flat"])
def test_the_lanczos_solver_finds_lapacks_top_eigenpairs(spectrum):
    """Top 16 of a 600 x 600 matrix (under the Lanczos share): the same values and, signs aside, vectors as
    LAPACK's subset solver, where the leading eigenvalues stand apart and where they crowd (a random Gram)."""
    rng = np.random.default_rng(3)
    rows = np.concatenate(adapter_rows(80, 600)) if spectrum == "adapters" else rng.standard_normal((900, 600))
    matrix = rows.T @ rows
    values, vectors = HostAlgebra().top_eigenpairs(matrix, 16)
    exact_values, exact_vectors = np.linalg.eigh(matrix)
    np.testing.assert_allclose(values, exact_values[::-1][:16], rtol=1e-10)
    alignment = np.abs(np.sum(vectors * exact_vectors[:, ::-1][:, :16], axis=0))
    gaps = -np.diff(exact_values[::-1][:17]) / exact_values[-1]
    assert alignment[gaps > 1e-6].min() > 1 - 1e-8, alignment  # a vector is defined where its value stands apart


@pytest.mark.parametrize("path", ["covariance", "gram", "randomized"])
def test_torch_finds_numpys_components_on_every_path(path):
    """The torch algebra (on the CPU here; on a GPU in make gpu-check) against numpy: the same vectors, signs
    included, and the same shares, whether the moment (more rows than d), the Gram matrix or the range finder."""
    blocks = adapter_rows(40 if path == "gram" else 120, 256 if path != "gram" else 512)
    rows, dimension = np.concatenate(blocks), blocks[0].shape[1]
    method = "randomized" if path == "randomized" else "exact"
    assert (len(rows) < dimension) == (path == "gram")
    found = {
        name: shared_components(
            lambda: iter(blocks),
            len(rows),
            dimension,
            MPI.COMM_SELF,
            method,
            10,
            0.99,
            power_iterations=0,
            algebra=algebra,
        )  # fmt: skip
        for name, algebra in (("numpy", HostAlgebra()), ("torch", TorchAlgebra("cpu")))
    }
    np.testing.assert_allclose(found["torch"].vectors, found["numpy"].vectors, atol=1e-9)
    np.testing.assert_allclose(found["torch"].explained, found["numpy"].explained, rtol=1e-10)
    largest = found["numpy"].vectors[np.arange(10), np.argmax(np.abs(found["numpy"].vectors), axis=1)]
    assert (largest > 0).all()  # each sign fixed: its largest entry positive


@pytest.mark.parametrize("noise", [0.05, 1.0])
def test_float32_with_one_refinement_keeps_the_explained_shares_within_1e_6(noise):
    """The eigensolver in float32 and one Rayleigh-Ritz step in float64: each kept component's share within 1e-6
    of float64's, and its vector closer to float64's than float32's own, for a clear shared subspace and for one
    drowned in noise (where the eigenvalues crowd)."""
    blocks = adapter_rows(200, 384, noise=noise, seed=7)
    rows = np.concatenate(blocks)

    def found(algebra):
        return shared_components(lambda: iter(blocks), len(rows), 384, MPI.COMM_SELF, "exact", 12, 0.99,
                                 algebra=algebra)  # fmt: skip

    double, single = found(TorchAlgebra("cpu")), found(TorchAlgebra("cpu", "float32"))
    assert np.abs(single.explained - double.explained).max() < 1e-6
    rough = torch.linalg.eigh(torch.from_numpy(rows.T @ rows).float())[1][:, -12:].flip(1).T.double().numpy()
    rough *= np.sign(np.sum(rough * double.vectors, axis=1))[:, None]  # float32's own vectors, signs aligned
    refined_error = np.abs(single.vectors - double.vectors).max()
    assert refined_error < 1e-5 and refined_error < np.abs(rough - double.vectors).max()


def test_float32_on_a_flat_spectrum_is_solved_again_in_float64():
    """Eigenvalues 1 to 1 + 1e-4: float32 cannot tell the vectors apart and one refinement gains almost nothing.
    The residual check sees it, and the answer is float64's; ten leading eigenvalues clear of the rest keep their
    float32 solve."""
    rng = np.random.default_rng(5)
    rotation = np.linalg.qr(rng.standard_normal((300, 300)))[0]
    flat = (rotation * (1.0 + 1e-4 * np.linspace(0, 1, 300))) @ rotation.T
    algebra = TorchAlgebra("cpu", "float32")
    values, vectors = algebra.top_eigenpairs(torch.from_numpy(flat), 10)
    assert algebra.solved_again == 1
    exact = np.linalg.eigvalsh(flat)[::-1][:10]
    np.testing.assert_allclose(values, exact, rtol=1e-13)
    residuals = np.linalg.norm(flat @ vectors.numpy() - vectors.numpy() * values, axis=0)
    assert residuals.max() < 1e-12
    spread = (rotation * np.concatenate([np.linspace(100, 50, 10), np.linspace(1, 0.1, 290)])) @ rotation.T
    algebra.top_eigenpairs(torch.from_numpy(spread), 10)
    assert algebra.solved_again == 1  # kept: its residuals pass


def test_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="precision must be one of float64, float32"):
        TorchAlgebra("cpu", "float16")
