"""The memory store's numba.cuda kernels give the CPU kernels' bits: on the CUDA simulator (no GPU needed), and on
a real GPU when there is one (`make gpu-check` sets MPISCALE_REQUIRE_GPU=1, so a missing GPU fails instead)."""

import os
import subprocess
import sys
import textwrap

import pytest
from helpers import real_gpu

SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    from numba import config, cuda
    import mpiscale
    from mpiscale.kernels import memstore_cuda
    from mpiscale.kernels.memstore import fused_pass
    from mpiscale.memstore import MemoryStore, best_by_quality

    assert config.ENABLE_CUDASIM == (sys.argv[1] == "simulator")
    rng = np.random.default_rng(0)

    buffers = memstore_cuda.PassBuffers()  # kept from pass to pass, as a partition keeps them

    def same_pass(n, k, crowded, spread):
        strength = rng.random(n, dtype=np.float32)
        quality = (rng.random(n, dtype=np.float32) * spread + (1 - spread) / 2).astype(np.float32)
        if n:
            quality[::5] = quality[0]  # ties, broken by id
            quality[1:3] = [-0.0, 0.0]  # equals that differ in their bits
            quality[3:5] = [-0.5, 1.5]  # outside the histogram's range: the end bins
        ids = rng.permutation(10**6)[:n].astype(np.int64)
        memstore_cuda._CROWDED = crowded
        device = [cuda.to_device(a) for a in (strength, quality, ids)]
        gpu = memstore_cuda.iteration_pass(*device, np.float32(0.01), 0.0, 1.0, 16, k, buffers)
        cpu = fused_pass(strength, quality, ids, np.float32(0.01), 0.0, 1.0, 16, k)
        assert np.array_equal(device[0].copy_to_host(), strength), "decay"
        assert (gpu.count, gpu.maximum) == (cpu.count, cpu.maximum)
        assert np.array_equal(gpu.histogram, cpu.histogram) and np.array_equal(gpu.exponents, cpu.exponents)
        ours = best_by_quality(gpu.candidates_quality, gpu.candidates_ids, k)
        theirs = best_by_quality(cpu.candidates_quality, cpu.candidates_ids, k)
        assert all(np.array_equal(a, b) for a, b in zip(ours, theirs)), (ours, theirs)
        return len(gpu.candidates_ids)

    # small partitions: the simulator runs every CUDA thread as a Python thread, 256 to a block, and a loaded
    # machine stretches each of their meetings (2,000 records a pass took over 300 s in all under load)
    assert same_pass(600, 10, 4096, 1.0) < 20  # the top-k and the ties of its last entry
    assert same_pass(500, 7, 8, 1e-3) < 100  # a crowded threshold bin, split by the keys' low bits
    same_pass(200, 500, 4096, 1.0)  # k larger than the partition
    same_pass(0, 5, 4096, 1.0)
    made = buffers.allocations
    assert same_pass(600, 10, 4096, 1.0) < 20 and same_pass(500, 7, 8, 1e-3) < 100
    assert buffers.allocations == made, "an iteration allocated device memory"

    async def main(system):
        stores = [MemoryStore(system, histogram_bins=8, device=d, device_threshold=0) for d in ("cuda", "cpu")]
        ids = rng.choice(10**9, 500, replace=False).astype(np.int64)
        values = {"strength": rng.random(500, dtype=np.float32), "quality": rng.random(500, dtype=np.float32)}
        results = []
        for store in stores:
            await store.upsert(ids, values)
            for iteration in range(3):
                await store.reinforce(ids[iteration::7], np.full(len(ids[iteration::7]), 0.2, np.float32), iteration)
                results.append(await store.iterate(0.05, k=6))
            await store.upsert(ids[:50], {"strength": values["strength"][:50], "quality": values["quality"][50:100]})
            results.append(await store.iterate(0.05, k=6))
        assert stores[0].partition.on_device and not stores[1].partition.on_device
        half = len(results) // 2
        for gpu, cpu in zip(results[:half], results[half:]):
            assert (gpu.count, gpu.total, gpu.maximum) == (cpu.count, cpu.total, cpu.maximum)
            assert np.array_equal(gpu.histogram, cpu.histogram) and np.array_equal(gpu.top_ids, cpu.top_ids)
        found = [await store.lookup(ids) for store in stores]
        assert np.array_equal(found[0][1], found[1][1]), "records after GPU iterations"
        print(f"memstore cuda ok ({sys.argv[1]})")

    mpiscale.run(main)
    """
)


def run(mode: str, env: dict) -> subprocess.CompletedProcess:
    env = {**env, "MPISCALE_TELEMETRY": "0"}  # no records file in the repository
    return subprocess.run([sys.executable, "-c", SCRIPT, mode], env=env, capture_output=True, text=True, timeout=600)


def test_cuda_kernels_and_a_gpu_store_match_the_cpu_on_the_simulator():
    done = run("simulator", {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"})
    assert done.returncode == 0, done.stdout + done.stderr[-6000:]
    assert "memstore cuda ok (simulator)" in done.stdout


def test_cuda_kernels_and_a_gpu_store_match_the_cpu_on_a_real_gpu():
    if not real_gpu():
        pytest.skip("no CUDA GPU on this machine (make gpu-check runs this where there is one)")
    done = run("real", {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"})
    assert done.returncode == 0, done.stdout + done.stderr[-6000:]
    assert "memstore cuda ok (real)" in done.stdout
