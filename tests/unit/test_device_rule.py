"""The jobs' GPU rule: one rank per GPU decided by the GPUs' identity (UUIDs each rank sees), two ranks on one GPU
refused unless shared on purpose, ``auto`` on the CPU where ``cuda`` would refuse, ``cuda`` refused in one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from mpi4py import MPI

from mpiscale.gpus import GpuChoice, assign_gpus
from mpiscale.jobs import choose_torch_device, mpi_cuda_aware

FOUR = ["GPU-a", "GPU-b", "GPU-c", "GPU-d"]


def test_ranks_that_see_every_gpu_take_one_each_in_host_order():
    assert assign_gpus([FOUR] * 4) == [GpuChoice(k, FOUR[k]) for k in range(4)]
    assert [c.index for c in assign_gpus([FOUR * 2] * 2)] == [0, 1]


def test_slurm_gpus_per_task_one_gpu_seen_by_each_rank_is_one_rank_per_gpu():
    """--gpus-per-task=1: every rank sees exactly one GPU (its own), at index 0. Counting ranks against the GPUs a
    rank sees refused this: '4 ranks on this host and 1 GPU'."""
    assert assign_gpus([[uuid] for uuid in FOUR]) == [GpuChoice(0, uuid) for uuid in FOUR]


def test_mig_slices_and_other_orders_are_placed_by_identity():
    assert assign_gpus([["MIG-1", "MIG-2"], ["MIG-2", "MIG-1"]]) == [GpuChoice(0, "MIG-1"), GpuChoice(0, "MIG-2")]
    bound = [["GPU-a", "GPU-b"], ["GPU-a", "GPU-b"], ["GPU-c", "GPU-d"], ["GPU-c", "GPU-d"]]  # --gpu-bind, 2 each
    assert assign_gpus(bound) == [GpuChoice(0, "GPU-a"), GpuChoice(1, "GPU-b"), GpuChoice(0, "GPU-c"),
                                  GpuChoice(1, "GPU-d")]  # fmt: skip


def test_two_ranks_on_one_gpu_are_refused_unless_shared_on_purpose():
    with pytest.raises(ValueError) as refused:
        assign_gpus([FOUR] * 8)
    text = str(refused.value)
    assert "\n" not in text and text.startswith("ranks 0, 4 of this host would share GPU GPU-a (8 ranks and 4 GPUs")
    assert "start one rank per GPU, or set MPISCALE_SHARE_GPUS=1" in text
    with pytest.raises(ValueError, match="ranks 0-1 of this host would share GPU GPU-a"):
        assign_gpus([["GPU-a", "GPU-b"], ["GPU-a"]])  # different views that land on one GPU
    assert [c.index for c in assign_gpus([FOUR] * 8, share=True)] == [0, 1, 2, 3] * 2
    assert [c.index for c in assign_gpus([["GPU-a"]] * 3, share=True)] == [0, 0, 0]


def test_a_rank_that_sees_no_gpu_is_refused_even_when_shared():
    with pytest.raises(ValueError, match="torch sees no CUDA GPU for rank 1 of this host"):
        assign_gpus([["GPU-a"], []], share=True)


def test_the_rule_on_one_process_with_made_up_gpus(monkeypatch, capsys):
    monkeypatch.delenv("MPISCALE_SHARE_GPUS", raising=False)
    assert choose_torch_device("cuda", MPI.COMM_SELF, seen=["GPU-x", "GPU-y"]) == "cuda:0"
    assert choose_torch_device("auto", MPI.COMM_SELF, seen=["GPU-y"]) == "cuda:0"
    assert choose_torch_device("cpu", MPI.COMM_SELF, seen=["GPU-y"]) == "cpu"
    assert capsys.readouterr().out == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a GPU: make gpu-check covers it")
def test_without_a_gpu_auto_is_the_cpu_and_cuda_is_refused_in_one_line(capsys):
    assert choose_torch_device("cpu", MPI.COMM_SELF) == "cpu"
    assert choose_torch_device("auto", MPI.COMM_SELF) == "cpu"
    assert capsys.readouterr().out == ""  # no note where no rank has a GPU
    with pytest.raises(ValueError) as refused:
        choose_torch_device("cuda", MPI.COMM_SELF)
    assert "\n" not in str(refused.value) and "sees no CUDA GPU" in str(refused.value)
    with pytest.raises(ValueError, match="--device must be one of auto, cpu, cuda, got 'gpu'"):
        choose_torch_device("gpu", MPI.COMM_SELF)


@pytest.mark.skipif(shutil.which("ompi_info") is None, reason="not Open MPI")
def test_open_mpi_says_at_run_time_whether_it_takes_device_buffers():
    """The library's own run-time answer, not its build flag: CUDA support turned off for one run is seen."""
    assert mpi_cuda_aware() in (True, False)
    check = "from mpiscale.jobs import mpi_cuda_aware; print(mpi_cuda_aware())"
    off = {**os.environ, "OMPI_MCA_opal_cuda_support": "0"}
    done = subprocess.run([sys.executable, "-c", check], env=off, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stdout + done.stderr
