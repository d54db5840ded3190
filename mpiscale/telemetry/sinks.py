"""Where rank 0's records go: an MQTT broker (aiomqtt), or a JSON-lines file when there is none.

The MQTT sink never slows the job: ``publish`` only appends to a bounded
buffer (the oldest record is dropped, and counted, when it is full), and one
background task sends it. A broker that is down at the start, goes away or is
slow costs reconnections with exponential backoff and jitter; after
``BREAKER_FAILURES`` failures in a row the sink stops trying for
``BREAKER_PAUSE_S`` (a circuit breaker). The status topic is retained, and
the broker's last will marks the job ``lost`` if the connection drops
without a goodbye (rank 0 killed, the node gone).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import ssl
import time
from collections import deque
from pathlib import Path

from .schema import record
from .settings import TelemetrySettings

log = logging.getLogger(__name__)

BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.5, 30.0
BREAKER_FAILURES, BREAKER_PAUSE_S = 8, 60.0  # 8 failures in a row: about a minute of backoff
#: The broker declares the job lost (its last will) if it hears nothing for 1.5 times this; a dead rank 0's socket
#: closes at once and needs no keepalive, but rank 0's event loop may be busy for seconds (a long kernel).
KEEPALIVE_S = 60
CLOSE_TIMEOUT_S = 5.0  # the longest a job's end waits for the last records to reach a connected broker
CLOSE_UNCONNECTED_S = 0.5  # ... and for a connection to come back (none if there never was one: a dead broker
# must not delay the end)
#: paho's own log (through aiomqtt) reports every reset socket as an error; the sink reports what matters itself.
_PAHO_LOG = logging.getLogger("mpiscale.telemetry.mqtt")
_PAHO_LOG.setLevel(logging.CRITICAL)


def topic(job: str, kind: str) -> str:
    return f"mpiscale/{job}/{kind}"


class FileSink:
    """Appends each record as one JSON line (the embedded default); a full disk drops records, never the job."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.dropped = 0
        self._stream = open(path, "a", buffering=1)

    def publish(self, payload: dict, retain: bool = False) -> None:
        try:
            self._stream.write(json.dumps(payload) + "\n")
        except OSError as error:
            if not self.dropped:
                log.warning("telemetry: %s: %s; records are dropped", self.path, error)
            self.dropped += 1

    async def close(self) -> None:
        with contextlib.suppress(OSError):  # the last line's flush on a full disk
            self._stream.close()


class MqttSink:
    """Publishes records under ``mpiscale/<job>/`` from a background task; ``publish`` never waits."""

    def __init__(self, settings: TelemetrySettings, job: str, lost: dict) -> None:
        self.settings, self.job = settings, job
        self.dropped = 0
        self.connected = False
        self._ever_connected = False
        self._queue: deque[tuple[str, bytes, bool]] = deque()
        self._wake = asyncio.Event()
        self._closing = False
        self._last_status: tuple[str, bytes, bool] | None = None
        self._lost = json.dumps(lost).encode()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="mpiscale-telemetry-mqtt")

    def publish(self, payload: dict, retain: bool = False) -> None:
        item = (topic(self.job, payload["kind"]), json.dumps(payload).encode(), retain)
        if payload["kind"] == "status":
            self._last_status = item  # sent again at every reconnection: a last will may have replaced it
        if len(self._queue) >= self.settings.buffer:
            self._queue.popleft()
            self.dropped += 1
        self._queue.append(item)
        self._wake.set()

    def _client(self):
        import aiomqtt

        settings = self.settings
        assert settings.broker is not None
        tls = ssl.create_default_context(cafile=settings.tls_ca) if settings.tls_ca else None
        will = aiomqtt.Will(topic(self.job, "status"), self._lost, qos=1, retain=True)
        return aiomqtt.Client(
            settings.broker[0], settings.broker[1], username=settings.username, password=settings.password,
            will=will, tls_context=tls, timeout=5.0, keepalive=KEEPALIVE_S,
            identifier=f"mpiscale-{self.job}", logger=_PAHO_LOG,
        )  # fmt: skip

    async def _run(self) -> None:
        import aiomqtt

        failures, paused_until = 0, 0.0
        while True:
            if self._closing and not self._queue:
                return
            if time.monotonic() < paused_until:
                if self._closing:
                    return
                await asyncio.sleep(min(1.0, paused_until - time.monotonic()))
                continue
            try:
                async with self._client() as client:
                    self.connected, self._ever_connected, failures = True, True, 0
                    if self._last_status is not None and self._last_status not in self._queue:
                        self._queue.appendleft(self._last_status)
                    await self._send(client)
                    return
            except (aiomqtt.MqttError, OSError) as error:
                self.connected = False
                failures += 1
                if failures >= BREAKER_FAILURES:
                    log.warning("telemetry: broker %s unreachable %d times (%s); pausing %.0f s",
                                self.settings.broker, failures, error, BREAKER_PAUSE_S)  # fmt: skip
                    paused_until, failures = time.monotonic() + BREAKER_PAUSE_S, 0
                    continue
                delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (failures - 1)) * random.uniform(0.5, 1.5)
                if self._closing:
                    return
                await asyncio.sleep(delay)

    async def _send(self, client) -> None:
        """Send the buffer as it fills, until closing with an empty buffer."""
        while True:
            while self._queue:
                name, body, retain = self._queue[0]
                await client.publish(name, body, qos=1 if retain else 0, retain=retain, timeout=5.0)
                self._queue.popleft()
            if self._closing:
                return
            self._wake.clear()
            await self._wake.wait()

    async def close(self) -> None:
        """Send what is buffered and disconnect cleanly: for at most ``CLOSE_TIMEOUT_S`` while connected, and
        ``CLOSE_UNCONNECTED_S`` while not (a connection made meanwhile gets the longer time, so that it ends
        with a goodbye rather than the last will)."""
        self._closing = True
        self._wake.set()
        began = time.monotonic()
        while not self._task.done():
            limit = CLOSE_TIMEOUT_S if self.connected else CLOSE_UNCONNECTED_S if self._ever_connected else 0.0
            left = began + limit - time.monotonic()
            if left <= 0:
                self._task.cancel()
                log.warning("telemetry: %d records not sent to %s at the end", len(self._queue), self.settings.broker)
                return
            await asyncio.wait({self._task}, timeout=min(left, 0.05))


def lost_status(job: str, command: str, ranks: int, host: str) -> dict:
    """The last will: what the retained status says if the job's connection drops without a goodbye."""
    return record("status", job, state="lost", command=command, ranks=ranks, host=host)
