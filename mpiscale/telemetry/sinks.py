"""Where rank 0's records go: an MQTT broker (aiomqtt), or a JSON-lines file when there is none.

The MQTT sink never slows the job: ``publish`` only appends to a bounded
buffer (the oldest record is dropped, and counted, when it is full), and one
task on an event loop of its own, in its own thread, sends it: records still
go out while the job's loop is busy (Numba compiling, a long kernel). Both
sinks take records from any thread. A broker that is down at the start, goes away or is
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
import os
import random
import ssl
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from .schema import record
from .settings import TelemetrySettings

log = logging.getLogger(__name__)

BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.5, 30.0
BREAKER_FAILURES, BREAKER_PAUSE_S = 8, 60.0  # 8 failures in a row: about a minute of backoff
#: The broker declares the job lost (its last will) if it hears nothing for 1.5 times this; a dead rank 0's socket
#: closes at once and needs no keepalive, but rank 0's event loop may be busy for seconds (a long kernel).
KEEPALIVE_S = 60
CLOSE_TIMEOUT_S = 5.0  # the longest a job's end waits for its last records to reach the broker
CLOSE_UNCONNECTED_S = 0.5  # ... and for a lost connection to come back, retried every CLOSING_RETRY_S: a broker
# back in the meantime gets the final status
CLOSING_RETRY_S = 0.05
_TAIL_BYTES = 1 << 20  # how much of a telemetry file's end a restart reads for its previous run's failure
#: paho's own log (through aiomqtt) reports every reset socket as an error; the sink reports what matters itself.
_PAHO_LOG = logging.getLogger("mpiscale.telemetry.mqtt")
_PAHO_LOG.setLevel(logging.CRITICAL)


def topic(job: str, kind: str) -> str:
    return f"mpiscale/{job}/{kind}"


def mqtt_client(
    settings: TelemetrySettings, identifier: str | None = None, will: tuple[str, bytes] | None = None,
    refused: Callable[[str], None] | None = None,
):  # fmt: skip
    """An aiomqtt client for the configured broker, with its user, password and TLS (a job's, or a watcher's).

    It speaks MQTT 5, whose acknowledgements carry a reason: ``refused(reason)`` hears of every QoS 1 publish the
    broker refused (an ACL that does not let this user write the topic: under MQTT 3.1.1 the broker drops such a
    publish without a word)."""
    import aiomqtt

    assert settings.broker is not None
    if settings.tls_ca and not os.path.isfile(settings.tls_ca):
        raise FileNotFoundError(f"MPISCALE_BROKER_CA={settings.tls_ca}: no such file")
    tls = ssl.create_default_context(cafile=settings.tls_ca) if settings.tls_ca else None
    last_will = aiomqtt.Will(will[0], will[1], qos=1, retain=True) if will is not None else None

    class Client(aiomqtt.Client):
        def _on_publish(self, client, userdata, mid, reason_code, properties) -> None:
            if refused is not None and getattr(reason_code, "is_failure", False):
                refused(str(reason_code))
            super()._on_publish(client, userdata, mid, reason_code, properties)

    return Client(
        settings.broker[0], settings.broker[1], username=settings.username, password=settings.password,
        will=last_will, tls_context=tls, timeout=5.0, keepalive=KEEPALIVE_S, identifier=identifier, logger=_PAHO_LOG,
        protocol=aiomqtt.ProtocolVersion.V5,
    )  # fmt: skip


class FileSink:
    """Appends each record as one JSON line (the embedded default); a full disk drops records, never the job.

    Until ``accept`` the records wait in memory and no file is touched: a job
    refused for bad input (``discard``) leaves no file, and never appends to the
    file of an earlier run with the same outputs. A sink closed without either
    (a job that has no checks to pass) writes them at its close.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.dropped = 0
        self._held: list[str] | None = []  # None once accepted or discarded
        self._stream: TextIO | None = None
        self._lock = threading.Lock()  # rank 0's heartbeat thread writes too

    def accept(self) -> bool:
        """Open the file and write the records held so far; False (and a warning) when it cannot be written."""
        with self._lock:
            if self._held is None:
                return self._stream is not None
            held, self._held = self._held, None
            try:
                self._stream = open(self.path, "a", buffering=1)
            except OSError as error:  # telemetry never stops a job: the job says what is wrong with its outputs
                log.warning("telemetry: %s cannot be written (%s); no telemetry for this job", self.path, error)
                return False
            for line in held:  # under the lock: a record published meanwhile comes after them
                self._write(line)
        return True

    def discard(self) -> None:
        """Drop the held records and every later one: the job was refused before it began."""
        with self._lock:
            if self._held is not None:
                self._held = None

    def publish(self, payload: dict, retain: bool = False) -> None:
        line = json.dumps(payload) + "\n"
        with self._lock:
            if self._held is not None:
                self._held.append(line)
            else:
                self._write(line)

    def _write(self, line: str) -> None:
        """One line to the file (the lock held)."""
        if self._stream is None or self._stream.closed:
            return
        try:
            self._stream.write(line)
        except OSError as error:
            if not self.dropped:
                log.warning("telemetry: %s: %s; records are dropped", self.path, error)
            self.dropped += 1

    def previous_failure(self) -> str | None:
        """Why the run before this one ended, when its last status in the file says it failed: its failure event's
        detail (who failed). A restarted job says it, since the run that failed may have lost its output with its
        node (Slurm's batch host: the job's stderr went with it, its telemetry did not)."""
        try:
            with open(self.path, "rb") as file:
                file.seek(max(0, file.seek(0, os.SEEK_END) - _TAIL_BYTES))
                tail = file.read().decode(errors="replace").splitlines()
        except OSError:
            return None
        failure = None
        for line in tail:
            try:
                payload = json.loads(line)
            except ValueError:  # a line cut by the tail's start, or half written when the run died
                continue
            if not isinstance(payload, dict):
                continue
            if payload.get("kind") == "status" and payload.get("state") == "running":
                failure = None  # a later run: its own failure or none
            elif payload.get("kind") == "event" and payload.get("event") == "failure":
                failure = f"{payload.get('detail')} (rank {payload.get('rank')})"
        return failure

    async def close(self) -> None:
        if self._held is not None:
            self.accept()
        with self._lock, contextlib.suppress(OSError):  # the last line's flush on a full disk
            if self._stream is not None:
                self._stream.close()


class MqttSink:
    """Publishes records under ``mpiscale/<job>/`` from a background task; ``publish`` never waits.

    With ``on_control``, it also subscribes to the job's control topic and
    hands each message's bytes to it (retained messages are ignored: a stale
    ``stop`` must not end the next run of the job).
    """

    def __init__(
        self, settings: TelemetrySettings, job: str, lost: dict, on_control: Callable[[bytes], None] | None = None
    ) -> None:
        if settings.broker is None:
            raise ValueError("an MQTT sink needs a broker (MPISCALE_BROKER)")
        self.settings, self.job, self.on_control = settings, job, on_control
        self.dropped = 0
        self.refused = 0  # publishes the broker acknowledged with a refusal (its ACL)
        self._heard_of: set[str] = set()  # topics whose first publish was sent acknowledged
        self.connected = False
        self._ever_connected = False
        self._said_unreachable = False
        self._queue: deque[tuple[str, bytes, bool]] = deque()
        self._lock = threading.Lock()  # the queue: filled by the job's threads, emptied by the sink's
        self._wake = asyncio.Event()
        self._closing = asyncio.Event()
        self._last_status: tuple[str, bytes, bool] | None = None
        self._lost = json.dumps(lost).encode()
        self._job_loop = asyncio.get_running_loop()  # control messages are handed to the job there
        self._loop = asyncio.new_event_loop()
        self._task = self._loop.create_task(self._run(), name="mpiscale-telemetry-mqtt")
        threading.Thread(target=self._serve, name="mpiscale-telemetry-mqtt", daemon=True).start()

    def _serve(self) -> None:
        """The sink's thread: its loop runs the sending task to its end (or its cancel), then closes."""
        asyncio.set_event_loop(self._loop)
        with contextlib.suppress(asyncio.CancelledError):
            self._loop.run_until_complete(self._task)
        self._loop.close()

    def _in_sink_loop(self, action: Callable[[], object]) -> None:
        with contextlib.suppress(RuntimeError):  # the sink's loop has ended: nothing is sent any more
            self._loop.call_soon_threadsafe(action)

    def publish(self, payload: dict, retain: bool = False) -> None:
        item = (topic(self.job, payload["kind"]), json.dumps(payload).encode(), retain)
        with self._lock:
            if payload["kind"] == "status":
                self._last_status = item  # sent again at every reconnection: a last will may have replaced it
            if len(self._queue) >= self.settings.buffer:
                self._queue.popleft()
                self.dropped += 1
            self._queue.append(item)
        self._in_sink_loop(self._wake.set)

    async def _run(self) -> None:
        import aiomqtt

        failures, paused_until, retry_until = 0, 0.0, None
        while True:
            if self._closing.is_set() and not self._queue:
                return
            if time.monotonic() < paused_until:
                if self._closing.is_set():
                    return
                await asyncio.sleep(min(1.0, paused_until - time.monotonic()))
                continue
            try:
                will = (topic(self.job, "status"), self._lost)
                # a client id of its own: a client that connects under a guessable one would take the job's session
                identifier = f"mpiscale-{self.job}-{uuid.uuid4().hex[:12]}"
                async with mqtt_client(self.settings, identifier, will, self._refused) as client:
                    self.connected, self._ever_connected, failures, retry_until = True, True, 0, None
                    with self._lock:
                        if self._last_status is not None and self._last_status not in self._queue:
                            self._queue.appendleft(self._last_status)
                    await self._connected(client)
                    return
            except (aiomqtt.MqttError, OSError, UnicodeError) as error:  # UnicodeError: a name no resolver takes
                self.connected = False
                if not self._ever_connected and not self._said_unreachable:
                    self._said_unreachable = True  # once: a wrong password or CA must not pass silently
                    reason = str(error) or type(error).__name__
                    log.warning("telemetry: cannot connect to the broker %s (%s); the job runs on, and its telemetry "
                                "is tried again in the background", self.settings.broker_shown, reason)  # fmt: skip
                if self._closing.is_set():  # the job's end: retry at once, for CLOSE_UNCONNECTED_S at most
                    # bounded here, not only by close()'s cancel: aiomqtt may turn a cancel in connect into MqttError
                    retry_until = retry_until or time.monotonic() + CLOSE_UNCONNECTED_S
                    if not self._ever_connected or time.monotonic() >= retry_until:
                        return
                    await asyncio.sleep(CLOSING_RETRY_S)
                    continue
                failures += 1
                if failures >= BREAKER_FAILURES:
                    log.warning("telemetry: broker %s unreachable %d times (%s); pausing %.0f s",
                                self.settings.broker_shown, failures, error, BREAKER_PAUSE_S)  # fmt: skip
                    paused_until, failures = time.monotonic() + BREAKER_PAUSE_S, 0
                    continue
                delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (failures - 1)) * random.uniform(0.5, 1.5)
                with contextlib.suppress(TimeoutError):  # the job's end cuts the backoff short
                    await asyncio.wait_for(self._closing.wait(), delay)

    def _refused(self, reason: str) -> None:
        """The broker refused a publish (said once: the ACL refuses the rest alike, acknowledged or not)."""
        self.refused += 1
        if self.refused == 1:
            user = self.settings.username or "(anonymous)"
            log.warning("telemetry: the broker %s refuses this job's publishes under mpiscale/%s/ (%s): its ACL "
                        "does not let user %s write there, so watchers see nothing of this job; with the documented "
                        "ACL, give the job an id under the user's name (MPISCALE_JOB_ID=%s/<id>)",
                        self.settings.broker_shown, self.job, reason, user, user)  # fmt: skip

    async def _connected(self, client) -> None:
        """Send, and receive control messages, until closing or until the connection fails (raised)."""
        tasks = [asyncio.create_task(self._send(client), name="mpiscale-telemetry-send")]
        if self.on_control is not None:
            await client.subscribe(topic(self.job, "control"), qos=1)
            tasks.append(asyncio.create_task(self._receive(client), name="mpiscale-telemetry-control"))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for task in done:
            task.result()  # a lost connection: raised, so that _run reconnects

    async def _receive(self, client) -> None:
        assert self.on_control is not None
        async for message in client.messages:
            if message.retain:
                log.warning("telemetry: ignored a retained message on %s", message.topic)
                continue
            body = bytes(message.payload) if message.payload is not None else b""
            self._job_loop.call_soon_threadsafe(self._control, body, str(message.topic))

    def _control(self, body: bytes, where: str) -> None:
        """A control message, handled on the job's loop."""
        assert self.on_control is not None
        try:
            self.on_control(body)
        except Exception:  # a bug the message found must not stop the job's telemetry: said, and skipped
            log.exception("telemetry: a control message on %s could not be handled; it is ignored", where)

    async def _send(self, client) -> None:
        """Send the buffer as it fills, until closing with an empty buffer."""
        while True:
            while self._queue:
                name, body, retain = self._queue[0]
                # the first record of each topic is acknowledged: a broker whose ACL refuses the topic says so (it
                # drops a refused QoS 0 publish without a word), the rest need no round trip
                acknowledged = retain or name not in self._heard_of
                self._heard_of.add(name)
                await client.publish(name, body, qos=1 if acknowledged else 0, retain=retain, timeout=5.0)
                with self._lock:
                    if self._queue and self._queue[0][1] is body:  # not dropped meanwhile for a full buffer
                        self._queue.popleft()
            if self._closing.is_set():
                return
            self._wake.clear()
            await self._wake.wait()

    async def close(self) -> None:
        """Send what is buffered and disconnect cleanly, for at most ``CLOSE_TIMEOUT_S`` in all; while unconnected,
        for at most ``CLOSE_UNCONNECTED_S`` since the connection was last up (at once if it never was: a dead
        broker must not delay a job's end). A connection made meanwhile ends with a goodbye, not the last will."""
        self._in_sink_loop(self._closing.set)
        self._in_sink_loop(self._wake.set)
        began = seen = time.monotonic()
        while not self._task.done():
            now = time.monotonic()
            if self.connected:
                seen = now
            unconnected_too_long = not self.connected and (
                not self._ever_connected or now - seen >= CLOSE_UNCONNECTED_S
            )
            if unconnected_too_long or now - began >= CLOSE_TIMEOUT_S:
                self._in_sink_loop(self._task.cancel)
                log.warning(
                    "telemetry: %d records not sent to %s at the end", len(self._queue), self.settings.broker_shown
                )
                return
            await asyncio.sleep(0.02)


def lost_status(job: str, command: str, ranks: int, host: str) -> dict:
    """The last will: what the retained status says if the job's connection drops without a goodbye."""
    return record("status", job, state="lost", command=command, ranks=ranks, host=host)
