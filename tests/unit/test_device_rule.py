"""The torch jobs' device rule: one rank per GPU, more ranks than GPUs refused unless shared on purpose, ``auto``
on the CPU when torch sees no GPU, ``cuda`` refused there in one line."""

from __future__ import annotations

import shutil

import pytest
import torch
from mpi4py import MPI

from mpiscale.jobs import choose_torch_device, gpu_for_rank, mpi_cuda_aware


def test_one_rank_per_gpu_in_host_order():
    assert [gpu_for_rank(rank, 4, 4) for rank in range(4)] == [0, 1, 2, 3]
    assert [gpu_for_rank(rank, 2, 8) for rank in range(2)] == [0, 1]


def test_more_ranks_than_gpus_are_refused_unless_shared_on_purpose():
    with pytest.raises(ValueError, match=r"8 ranks on this host and 4 GPUs: start one rank per GPU, or set "
                                         r"MPISCALE_SHARE_GPUS=1"):  # fmt: skip
        gpu_for_rank(5, 8, 4)
    assert [gpu_for_rank(rank, 3, 1, share=True) for rank in range(3)] == [0, 0, 0]
    assert [gpu_for_rank(rank, 8, 4, share=True) for rank in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_a_host_without_gpus_is_refused_even_when_shared():
    with pytest.raises(ValueError, match="torch sees no CUDA GPU on this host"):
        gpu_for_rank(0, 1, 0, share=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a GPU: make gpu-check covers it")
def test_without_a_gpu_auto_is_the_cpu_and_cuda_is_refused_in_one_line():
    assert choose_torch_device("cpu", MPI.COMM_SELF) == "cpu"
    assert choose_torch_device("auto", MPI.COMM_SELF) == "cpu"
    with pytest.raises(ValueError) as refused:
        choose_torch_device("cuda", MPI.COMM_SELF)
    assert "\n" not in str(refused.value) and "sees no CUDA GPU" in str(refused.value)
    with pytest.raises(ValueError, match="--device must be one of auto, cpu, cuda, got 'gpu'"):
        choose_torch_device("gpu", MPI.COMM_SELF)


@pytest.mark.skipif(shutil.which("ompi_info") is None, reason="not Open MPI")
def test_open_mpi_says_whether_it_takes_device_buffers():
    assert mpi_cuda_aware() in (True, False)
