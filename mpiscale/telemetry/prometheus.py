"""An optional Prometheus text endpoint on rank 0, for sites that scrape rather than subscribe.

``MPISCALE_PROMETHEUS_PORT=9464`` serves ``http://<rank 0's host>:9464/metrics``
(on ``MPISCALE_PROMETHEUS_ADDR``, every interface by default) from the same
records rank 0 publishes: a scrape reads the latest progress, metrics and
heartbeat, never the ranks themselves. Every sample carries the job's id as
the ``job_id`` label.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from .settings import bracketed

log = logging.getLogger(__name__)

_PROGRESS = {
    "step": "Steps every rank has completed",
    "total": "Steps the job will run",
    "steps_per_s": "Steps per second, over the recent reports",
    "items_per_s": "Items (signals, samples, records) per second over all ranks",
    "eta_s": "Estimated seconds to the end",
}


class PrometheusEndpoint:
    """Serves the latest records of one job in Prometheus's text format (call ``take`` with each record)."""

    def __init__(self, job: str, port: int, addr: str = "0.0.0.0") -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        self.job = job
        self.latest: dict[str, dict] = {}
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        self._server, self._thread = start_http_server(port, addr, registry=registry)

    @property
    def port(self) -> int:
        return int(self._server.server_port)

    def take(self, payload: dict) -> None:
        self.latest[payload["kind"]] = payload

    def collect(self) -> Iterator:
        """The samples of the latest records (prometheus_client's collector protocol)."""
        from prometheus_client.core import GaugeMetricFamily

        labels = ["job_id"]
        progress = self.latest.get("progress", {})
        for name, help_text in _PROGRESS.items():
            if progress.get(name) is not None:
                family = GaugeMetricFamily(f"mpiscale_{name}", help_text, labels=labels)
                family.add_metric([self.job], float(progress[name]))
                yield family
        metrics = self.latest.get("metrics")
        if metrics is not None:
            spread = GaugeMetricFamily(
                "mpiscale_rank_metric", "A metric's min, mean and max over the ranks", labels=[*labels, "name", "stat"]
            )
            for name, values in sorted(metrics["values"].items()):
                for stat in ("min", "mean", "max"):
                    spread.add_metric([self.job, name, stat], float(values[stat]))
            yield spread
            slowest = GaugeMetricFamily("mpiscale_slowest_rank", "The rank furthest behind", labels=labels)
            slowest.add_metric([self.job], float(metrics["slowest_rank"]))
            yield slowest
        beat = self.latest.get("heartbeat")
        if beat is not None:
            for name, help_text in (
                ("ranks_reporting", "Ranks whose reports rank 0 holds"),
                ("oldest_report_s", "Age of the stalest rank's last report, in seconds"),
                ("dropped", "Records the publisher had to drop"),
            ):
                family = GaugeMetricFamily(f"mpiscale_{name}", help_text, labels=labels)
                family.add_metric([self.job], float(beat[name]))
                yield family
            family = GaugeMetricFamily("mpiscale_heartbeat_time", "Unix time of the last heartbeat", labels=labels)
            family.add_metric([self.job], float(beat["time"]))
            yield family

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def open_endpoint(job: str, port: int, addr: str) -> PrometheusEndpoint | None:
    """The endpoint, or None with a warning when the port cannot be taken (the job runs on without it)."""
    try:
        endpoint = PrometheusEndpoint(job, port, addr)
    except OSError as error:
        log.warning("telemetry: no Prometheus endpoint on %s:%d (%s)", addr, port, error)
        return None
    print(f"telemetry: Prometheus metrics at http://{bracketed(addr)}:{endpoint.port}/metrics", flush=True)
    return endpoint
