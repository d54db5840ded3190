"""Telemetry settings, from ``MPISCALE_TELEMETRY_*`` and ``MPISCALE_BROKER*`` environment variables.

With no broker, records go to a JSON-lines file beside the results; nothing
else is needed to run a job.
"""

from __future__ import annotations

import ipaddress
import math
import os
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class TelemetrySettings:
    broker: tuple[str, int] | None = None  # MPISCALE_BROKER=host:port (port 1883 if left out)
    username: str | None = None  # MPISCALE_BROKER_USER
    password: str | None = None  # MPISCALE_BROKER_PASSWORD
    tls_ca: str | None = None  # MPISCALE_BROKER_CA: a CA file; connect with TLS
    interval_s: float = 2.0  # MPISCALE_TELEMETRY_INTERVAL_S: between reports and publications
    buffer: int = 1000  # MPISCALE_TELEMETRY_BUFFER: records kept while the broker is away (oldest dropped)
    enabled: bool = True  # MPISCALE_TELEMETRY=0 turns it off
    prometheus_port: int | None = None  # MPISCALE_PROMETHEUS_PORT: serve /metrics on rank 0 (0: any free port)
    prometheus_addr: str = "0.0.0.0"  # MPISCALE_PROMETHEUS_ADDR: the interface it listens on

    @property
    def broker_shown(self) -> str:
        """The broker's address as a user writes it: ``HOST:PORT``, or ``[IPv6]:PORT``; empty with no broker."""
        if self.broker is None:
            return ""
        host, port = self.broker
        return f"{bracketed(host)}:{port}"

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> TelemetrySettings:
        env = os.environ if environ is None else environ
        text = env.get("MPISCALE_BROKER", "").strip()
        broker = parse_broker(text) if text else None
        try:
            interval = float(env.get("MPISCALE_TELEMETRY_INTERVAL_S", "2"))
            buffer = int(env.get("MPISCALE_TELEMETRY_BUFFER", "1000"))
            scrape = int(env["MPISCALE_PROMETHEUS_PORT"]) if env.get("MPISCALE_PROMETHEUS_PORT") else None
        except ValueError as error:
            raise ValueError(f"telemetry settings: {error}") from None
        if not 0 < interval < math.inf or buffer < 1:  # NaN and inf would never report
            raise ValueError(
                "MPISCALE_TELEMETRY_INTERVAL_S must be a finite number > 0 and MPISCALE_TELEMETRY_BUFFER >= 1"
            )
        check_job_id(env.get("MPISCALE_JOB_ID", ""))
        if scrape is not None and not 0 <= scrape < 65536:
            raise ValueError(f"MPISCALE_PROMETHEUS_PORT={scrape}: a port is 0 to 65535")
        return cls(
            broker=broker,
            username=env.get("MPISCALE_BROKER_USER") or None,
            password=env.get("MPISCALE_BROKER_PASSWORD") or None,
            tls_ca=env.get("MPISCALE_BROKER_CA") or None,
            interval_s=interval,
            buffer=buffer,
            enabled=env.get("MPISCALE_TELEMETRY", "1") != "0",
            prometheus_port=scrape,
            prometheus_addr=env.get("MPISCALE_PROMETHEUS_ADDR") or "0.0.0.0",
        )


def bracketed(host: str) -> str:
    """``host`` as it is written before ``:PORT`` (in a URL too): an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


def parse_broker(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``HOST`` (port 1883), ``[IPv6]:PORT``, ``[IPv6]`` or a bare IPv6 address (port 1883) as the
    host a socket connects to (no brackets) and the port."""
    host, port = text, "1883"
    if text.startswith("["):
        host, bracket, after = text[1:].partition("]")
        port = after.removeprefix(":") if after else port
        if not bracket or (after and not after.startswith(":")) or not _is_ip_address(host):
            host = ""  # refused below
    elif ":" in text and not _is_ip_address(text):
        host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        why = "expected HOST:PORT, or HOST for port 1883 (an IPv6 address in brackets when a port follows: [::1]:1883)"
        raise ValueError(f"MPISCALE_BROKER={text!r}: {why}")
    check_host(host, "MPISCALE_BROKER")
    return host, int(port)


def _is_ip_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def check_host(host: str, variable: str) -> None:
    """Refuse a host name no resolver takes (a part over 63 characters, an empty part): said at the start, not as an
    error of a background task."""
    if _is_ip_address(host):
        return
    try:
        host.encode("idna")
    except UnicodeError:
        why = "each part between dots holds 1 to 63 characters"
        raise ValueError(f"{variable}: {host!r} is not a host name: {why}") from None


def check_job_id(job: str) -> None:
    """Refuse an ``MPISCALE_JOB_ID`` that cannot be a part of an MQTT topic (wildcards, NUL, empty levels)."""
    if not job:
        return
    bad = sorted({c for c in job if c in "#+\0"})
    if bad or job.startswith("/") or job.endswith("/") or "//" in job or len(job.encode()) > 200:
        raise ValueError(
            f"MPISCALE_JOB_ID={job!r}: a job id names MQTT topics, so it holds no # + or NUL, no empty part "
            "between slashes, and at most 200 bytes (user/1234 is fine)"
        )


def job_id(environ: dict[str, str] | None = None) -> str:
    """The job's id: ``MPISCALE_JOB_ID``, else Slurm's job id (with the array task), else host-pid-time."""
    env = os.environ if environ is None else environ
    if env.get("MPISCALE_JOB_ID"):
        return env["MPISCALE_JOB_ID"]
    if env.get("SLURM_JOB_ID"):
        task = env.get("SLURM_ARRAY_TASK_ID")
        return env["SLURM_JOB_ID"] + (f"_{task}" if task else "")
    import time

    return f"{socket.gethostname()}-{os.getpid()}-{int(time.time())}"


def restart_count(environ: dict[str, str] | None = None) -> int:
    """Which rerun of the job this is: 0 the first time (``launch/mpiscale-run --restarts``, or Slurm's requeue)."""
    env = os.environ if environ is None else environ
    return max(int(env.get(name, "0") or 0) for name in ("MPISCALE_RESTART_COUNT", "SLURM_RESTART_COUNT"))
