"""What rank 0 makes of the ranks' reports: each metric's spread over the ranks, each node's, and the job's pace.

Pure functions of the reports (no clock, no I/O), so that what a user reads in
``mpiscale watch`` is tested on its own.
"""

from __future__ import annotations


def spread(reports: dict[int, dict]) -> dict[str, dict[str, float]]:
    """Per metric (and ``step``): minimum, mean and maximum over the ranks that report it, and the lowest rank
    holding the minimum (``min_rank``; for ``step``, the rank furthest behind)."""
    values = {}
    names = {name for report in reports.values() for name in report["metrics"]} | {"step"}
    for name in sorted(names):
        found = {rank: (r["step"] if name == "step" else r["metrics"].get(name)) for rank, r in reports.items()}
        found = {rank: float(value) for rank, value in found.items() if value is not None}
        low = min(found, key=lambda rank: (found[rank], rank))
        values[name] = {"min": found[low], "mean": sum(found.values()) / len(found), "max": max(found.values()),
                        "min_rank": low}  # fmt: skip
    return values


def pace(recent: list[tuple[float, int, float]], total: int) -> tuple[float, float, float | None]:
    """(steps per second, items per second, seconds left or None) over ``recent`` (time, step, items) points,
    oldest first."""
    (first_time, first_step, first_items), (now, step, items) = recent[0], recent[-1]
    span = now - first_time
    steps_per_s = (step - first_step) / span if span > 0 else 0.0
    items_per_s = (items - first_items) / span if span > 0 else 0.0
    eta = (total - step) / steps_per_s if steps_per_s > 0 else None
    return steps_per_s, items_per_s, eta


NODES_SHOWN = 64  # a metrics record names at most this many nodes: the stalest


def by_node(reports: dict[int, dict]) -> list[dict]:
    """Per host of the reporting ranks: its ``ranks``, its ``step`` (the rank furthest behind there) and
    ``report_time`` (its stalest rank's last report), stalest node first, at most ``NODES_SHOWN`` of them."""
    hosts: dict[str, list[int]] = {}
    for rank in sorted(reports):
        hosts.setdefault(str(reports[rank].get("host", "?")), []).append(rank)
    nodes = [
        {"host": host, "ranks": ranks, "step": min(reports[r]["step"] for r in ranks),
         "report_time": min(reports[r]["time"] for r in ranks)}
        for host, ranks in hosts.items()
    ]  # fmt: skip
    return sorted(nodes, key=lambda node: (node["report_time"], node["step"], node["ranks"][0]))[:NODES_SHOWN]
