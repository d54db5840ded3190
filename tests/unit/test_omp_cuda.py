"""The numba.cuda Batch-OMP kernel gives the CPU kernel's codes: on the CUDA simulator (no GPU needed), and on a
real GPU when there is one (`make gpu-check` sets MPISCALE_REQUIRE_GPU=1, so a missing GPU fails instead)."""

import os
import subprocess
import sys
import textwrap

import pytest
from helpers import real_gpu

SCRIPT = textwrap.dedent(
    """
    import numpy as np
    from numba import config, cuda
    from mpiscale.dictlearn.coding import omp_encode
    from mpi4py import MPI
    from mpiscale.jobs import choose_numba_device
    from mpiscale.kernels.devices import gpu_uuids, resolve_device

    import sys
    if sys.argv[1] == "simulator":
        assert config.ENABLE_CUDASIM
        assert resolve_device("auto") == "cpu", "the simulator must never be picked automatically"
        many = 1  # the simulator takes about a second per signal
    else:
        assert not config.ENABLE_CUDASIM and cuda.is_available(), "no usable CUDA GPU"
        assert resolve_device("auto") == "cuda"
        many = 64
    rng = np.random.default_rng(0)
    for atoms, features, nonzero, signals in [(12, 8, 4, 4 * many), (6, 6, 6, 2 * many), (10, 5, 1, 2 * many)]:
        d = rng.standard_normal((atoms, features))
        d /= np.linalg.norm(d, axis=1, keepdims=True)
        x = rng.standard_normal((signals, features))
        gpu, cpu = omp_encode(x, d, nonzero, device="cuda"), omp_encode(x, d, nonzero, device="cpu")
        assert np.allclose(gpu, cpu, atol=1e-12), (atoms, np.abs(gpu - cpu).max())
        assert (np.count_nonzero(gpu, axis=1) <= nonzero).all()
    twins = np.vstack([d[:2], d[:2]])  # dependent atoms: both kernels stop at two
    x = d[:1] + 2 * d[1:2]
    assert np.count_nonzero(omp_encode(x, twins, 4, device="cuda")) == 2
    assert not omp_encode(np.zeros((3, 5)), d, 2, device="cuda").any()
    tiny = omp_encode(x * 1e-16, d, 3, device="cuda")  # the stop is relative to the signal, as on the CPU
    assert np.allclose(tiny / 1e-16, omp_encode(x, d, 3, device="cpu"), atol=1e-9)
    scales = np.linspace(0.1, 10, len(d))  # atoms of other norms: picked as the unit atoms are, on both
    x = rng.standard_normal((2 * many, d.shape[1]))
    scaled = omp_encode(x, d * scales[:, None], 3, device="cuda")
    assert np.allclose(scaled * scales, omp_encode(x, d, 3, device="cpu"), atol=1e-12)
    assert choose_numba_device("cuda", MPI.COMM_SELF) == "cuda:0"  # the jobs' GPU rule, by the GPUs' identity
    assert choose_numba_device("cpu", MPI.COMM_SELF) == "cpu"
    assert len(gpu_uuids()) == len(cuda.gpus) and all(uuid.startswith(("GPU-", "MIG-")) for uuid in gpu_uuids())
    print("cuda kernel matches")
    """
)


def test_cuda_kernel_matches_cpu_kernel_on_the_simulator():
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, "simulator"], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "cuda kernel matches" in done.stdout


def test_cuda_kernel_matches_cpu_kernel_on_a_real_gpu():
    if not real_gpu():
        pytest.skip("no CUDA GPU on this machine (make gpu-check runs this where there is one)")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, "gpu"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "cuda kernel matches" in done.stdout
