"""Training step time: ``mpiscale.train.DataParallel`` against PyTorch's DistributedDataParallel (gloo; NCCL on GPUs).

The same MLP, batch, ranks and torch threads for all, in one run: the step with
no communication (what overlap could at best reach), the gradient allreduce
alone (no backward to hide it behind), and then each compression scheme both
ways: ours (none, fp16, bf16, PowerSGD rank 4) against DDP with its own
communication hooks for the same scheme. Each figure is the median over steps
of the slowest rank's step time. The share of communication hidden behind
backward is ``1 - (step - compute) / communication``: the wall time the
overlap saves. Beside it, the share of the uncompressed buckets' allreduce
time that ran while backward still ran (each bucket's start and end timed):
the overlap itself, which saves nothing where the ranks' compute threads
already take every core (the allreduce's copies then take turns with them).

``--device cuda`` runs it on the ranks' GPUs (the jobs' device rule): ours with
its gradients staged through pinned host memory, DDP on NCCL, each step ended
by a device synchronisation so that the GPU's queued work is counted. NCCL
takes one rank per GPU (it refuses two ranks sharing one), so on a one-GPU
machine the comparison is at one rank: the step's own overhead against DDP's.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Awaitable, Callable

import numpy as np

from ..jobs import choose_torch_device
from ..kernels.threads import share_cores
from ..ranks import ranks_sharing_cores
from ..runtime import ActorSystem, run
from ..train import DataParallel
from ..train.compression import Exact, scheme
from .allreduce import init_torch_group
from .report import median_slowest_async, table, write_json

WIDTH, DEPTH, BATCH = 2048, 3, 64  # about 12.6M parameters: 50 MB of gradients per step
QUICK_WIDTH = 512  # --quick, the smoke run: 0.8M parameters
SCHEMES = ("none", "fp16", "bf16", "powersgd")
POWERSGD_RANK = 4


class _Timed(Exact):
    """Exact, timing each bucket's allreduce: when it started, and when it ended (in the reducer's thread)."""

    def __init__(self, system: ActorSystem) -> None:
        super().__init__(system)
        self.spans: dict[int, list[float]] = {}

    def start(self, bucket) -> None:
        super().start(bucket)
        span = self.spans[bucket.index] = [time.perf_counter(), 0.0]
        self._futures[bucket.index].add_done_callback(lambda _: span.__setitem__(1, time.perf_counter()))

    def during(self, backward_end: float) -> tuple[float, float]:
        """(seconds of allreduce that ran before ``backward_end``, seconds of allreduce in all)."""
        inside = sum(max(0.0, min(end, backward_end) - start) for start, end in self.spans.values())
        return inside, sum(end - start for start, end in self.spans.values())


def _model(torch, width: int):
    torch.manual_seed(0)
    layers = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


def _ddp_hook(torch, model, name: str) -> bool:
    """DDP's own communication hook for the scheme (none: its built-in allreduce); False where torch has none.

    torch's bf16 hook needs NCCL (CUDA) or XCCL: on gloo it refuses, so DDP has no bf16 column on CPUs.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "bf16":
        try:
            model.register_comm_hook(None, default_hooks.bf16_compress_hook)
        except TypeError:
            return False
    elif name == "powersgd":
        state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=POWERSGD_RANK, start_powerSGD_iter=2)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return True


async def run_ddp_bench(system: ActorSystem, json_path: str, quick: bool = False, device: str = "cpu") -> dict | None:
    """Time the steps every way on ``device`` (cpu or cuda); rank 0 prints the table and writes the JSON record."""
    import torch

    comm = system.world.comm
    torch.set_num_threads(share_cores(ranks_sharing_cores(comm)))  # this rank's share of the host's cores
    where = torch.device(choose_torch_device(device, comm))
    group = init_torch_group(comm, "nccl" if where.type == "cuda" else "gloo")
    if group is None:
        raise SystemExit("bench ddp needs torch (pip install torch)")
    _, dist = group
    steps, width = (4, QUICK_WIDTH) if quick else (12, WIDTH)
    x = torch.randn(BATCH, width, generator=torch.Generator().manual_seed(system.rank)).to(where)
    y = torch.randn(BATCH, 1, generator=torch.Generator().manual_seed(system.rank + 100)).to(where)

    def backward(model, optimizer) -> None:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()

    def done() -> None:  # the GPU's queued work counted in the step
        if where.type == "cuda":
            torch.cuda.synchronize(where)

    local = _model(torch, width).to(where)
    local_optimizer = torch.optim.SGD(local.parameters(), lr=1e-4)

    async def compute_only() -> None:
        backward(local, local_optimizer)
        local_optimizer.step()
        done()

    overlap = [0.0, 0.0]  # uncompressed: seconds of allreduce during backward, and in all

    def ours(name: str) -> tuple[Callable[[], Awaitable[None]], DataParallel]:
        model = _model(torch, width).to(where)
        timed = _Timed(system) if name == "none" else None
        compression = timed or scheme(system, name, POWERSGD_RANK, powersgd_start=2)
        parallel = DataParallel(system, model, compression=compression)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

        async def step() -> None:
            backward(model, optimizer)
            done()
            backward_end = time.perf_counter()
            await parallel.synchronize()
            if timed is not None:
                inside, total = timed.during(backward_end)
                overlap[0] += inside
                overlap[1] += total
            optimizer.step()
            done()

        return step, parallel

    def ddp(name: str) -> Callable[[], Awaitable[None]] | None:
        # torch's PowerSGD hook chains each bucket's second allreduce in a callback; on gloo, with several buckets,
        # the ranks issued those in different orders and gloo aborted (a collective mismatch). One bucket avoids it.
        cap = 1024 if name == "powersgd" else None
        ids = [where.index] if where.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(_model(torch, width).to(where), device_ids=ids,
                                                          bucket_cap_mb=cap)  # fmt: skip
        if not _ddp_hook(torch, model, name):
            return None
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

        async def step() -> None:
            backward(model, optimizer)
            optimizer.step()
            done()

        return step

    seconds: dict[str, float | None] = {"compute_only": await median_slowest_async(system, compute_only, steps)}
    for name in SCHEMES:
        step, parallel = ours(name)
        await parallel.broadcast_parameters()
        for _ in range(3):  # past PowerSGD's exact warm-up steps
            await step()
        overlap[:] = [0.0, 0.0]
        seconds[f"ours_{name}"] = await median_slowest_async(system, step, steps)
        if name == "none":
            during = overlap[0] / overlap[1] if overlap[1] else 0.0
            # the same buckets with gradients in place: the allreduces alone, nothing to hide behind
            seconds["communication_only"] = await median_slowest_async(system, parallel.synchronize, steps)
        del step, parallel
        step_ddp = ddp(name)
        if step_ddp is None:
            seconds[f"ddp_{name}"] = None
            continue
        for _ in range(3):
            await step_ddp()
        seconds[f"ddp_{name}"] = await median_slowest_async(system, step_ddp, steps)
    dist.destroy_process_group()
    if system.rank != 0:
        return None
    parameters = sum(p.numel() for p in local.parameters())
    return _report(system, json_path, seconds, width, parameters, steps, torch, str(where), during)


def _hidden_share(step: float, compute: float, communication: float) -> float:
    """The share of ``communication`` that ``step`` hides behind compute, in [0, 1].

    Noise on a loaded machine can make a step measure faster than compute alone (above 1)
    or slower than compute plus communication (below 0); the share is clipped to what it can mean.
    """
    if communication <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - (step - compute) / communication))


def _report(
    system: ActorSystem,
    json_path: str,
    seconds: dict,
    width: int,
    parameters: int,
    steps: int,
    torch,
    device: str,
    during: float,
) -> dict:
    compute, communication = seconds["compute_only"], seconds["communication_only"]
    hidden = _hidden_share(seconds["ours_none"], compute, communication)
    print(f"training step of an MLP ({DEPTH} x {width}, {parameters / 1e6:.1f}M parameters, batch {BATCH} per rank), "
          f"{system.size} ranks on {system.hierarchy.node_count} nodes, {torch.get_num_threads()} torch threads "
          f"each, on {device}; median of {steps} steps")  # fmt: skip
    rows = [["compute only", compute * 1e3, "", ""], ["allreduce only (ours)", communication * 1e3, "", ""]]
    for name in SCHEMES:
        ours, ddp = seconds[f"ours_{name}"], seconds[f"ddp_{name}"]
        backend = "nccl" if device.startswith("cuda") else "gloo"
        versus = [ddp * 1e3, ddp / ours] if ddp is not None else [f"n/a ({backend})", ""]
        rows.append([f"compression {name}", ours * 1e3, *versus])
    print(table(["", "ours ms/step", "DDP ms/step", "DDP/ours"], rows))
    print(f"communication hidden behind backward (no compression): {hidden:.0%}; allreduce time that ran during "
          f"backward: {during:.0%}")  # fmt: skip
    if seconds["ours_none"] < compute:
        print("note: the full step measured faster than compute alone; the machine's noise exceeds the overlap here")
    results = {
        "ranks": system.size,
        "nodes": system.hierarchy.node_count,
        "device": device,
        "width": width,
        "parameters": parameters,
        "batch_per_rank": BATCH,
        "torch_threads": torch.get_num_threads(),
        "powersgd_rank": POWERSGD_RANK,
        "seconds_per_step": seconds,
        "ours_vs_ddp": {
            name: seconds[f"ddp_{name}"] / seconds[f"ours_{name}"] for name in SCHEMES if seconds[f"ddp_{name}"]
        },
        "hidden_share": hidden,
        "allreduce_during_backward_share": during,
        "gradient_bytes": int(np.float32().itemsize * parameters),
    }
    write_json(json_path, "ddp", system.size, results)
    return results


def command(args: argparse.Namespace) -> int:
    """``mpiscale bench ...``: the options parsed, the benchmark run, its table printed and its JSON written."""
    run(lambda system: run_ddp_bench(system, args.json, quick=args.quick, device=args.device))
    return 0
