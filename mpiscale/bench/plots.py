"""Pictures of three benchmarks' records, where a reader would rather look than read a table (``--plot FILE.png``):
round-trip time against message size, allreduce bus bandwidth against size, the pipeline's bubble against the
number of micro-batches."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def _figure(draw: Callable, image: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.4, 4.4))
    draw(axis)
    axis.set_title(title, fontsize=10)
    axis.grid(alpha=0.3, which="both")
    axis.legend()
    figure.tight_layout()
    figure.savefig(image, dpi=120)
    plt.close(figure)
    print(f"wrote {image}")


def round_trips(result: dict, image: str) -> None:
    """pingpong: the p50 round trip of each peer against the payload's size (log-log)."""
    records = result["round_trip"]
    sizes = np.array([record["bytes"] for record in records])
    lines = [("raw_rtt_s", "mpi4py Send/Recv (raw)"), ("persistent_rtt_s", "persistent requests"),
             ("mpi4py_pickle_rtt_s", "mpi4py send/recv (pickle)"), ("asyncio_floor_rtt_s", "asyncio loop floor"),
             ("ask_rtt_s", "mpiscale ask")]  # fmt: skip

    def draw(axis) -> None:
        for key, label in lines:
            axis.loglog(sizes, [record[key] * 1e6 for record in records], "o-", label=label, markersize=3)
        axis.set_xlabel("payload (bytes)")
        axis.set_ylabel("round trip, p50 (µs)")

    _figure(draw, image, "Round trip between two ranks against message size")


def bus_bandwidth(result: dict, image: str) -> None:
    """allreduce: the bus bandwidth of ours (hierarchical and world), MPI's, the non-blocking floor's and gloo's
    against the buffer's size."""
    records = result["sizes"]
    sizes = np.array([record["bytes"] for record in records])

    def draw(axis) -> None:
        for key, label in (("ours", "mpiscale (hierarchical)"), ("world", "mpiscale (world)"),
                           ("mpi", "MPI.Allreduce"), ("floor", "the same messages, bare non-blocking MPI"),
                           ("gloo", "torch gloo")):  # fmt: skip
            if f"{key}_busbw_gbs" in records[0]:
                axis.semilogx(sizes, [record[f"{key}_busbw_gbs"] for record in records], "o-", label=label)
        axis.set_xlabel("buffer (bytes of float32)")
        axis.set_ylabel("bus bandwidth (GB/s)")

    _figure(draw, image, f"Allreduce bus bandwidth, {result['ranks']} ranks on {result['nodes']} node(s)")


def bubble(result: dict, image: str) -> None:
    """pipeline: the share of a step each schedule leaves a stage idle, against the micro-batches, with the ideal
    pipeline's (S - 1) / (M + S - 1)."""
    stages = result["stages"]

    def draw(axis) -> None:
        for schedule in sorted({record["schedule"] for record in result["records"]}):
            chosen = [record for record in result["records"] if record["schedule"] == schedule]
            counts = [record["micro_batches"] for record in chosen]
            axis.plot(counts, [100 * record["ours_bubble"] for record in chosen], "o-", label=f"mpiscale {schedule}")
            axis.plot(counts, [100 * record["torch_bubble"] for record in chosen], "s--",
                      label=f"torch.distributed.pipelining {schedule}")  # fmt: skip
        every = np.array(sorted({record["micro_batches"] for record in result["records"]}))
        axis.plot(every, 100 * (stages - 1) / (every + stages - 1), "k:", label="ideal pipeline")
        axis.set_xlabel("micro-batches per step")
        axis.set_ylabel("bubble: share of the step a stage waits (%)")

    _figure(draw, image, f"Pipeline bubble, {stages} stages")
