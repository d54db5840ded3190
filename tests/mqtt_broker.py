"""A real mosquitto broker on a free loopback port, and a subscriber that keeps what it hears (for tests).

Loaded as a pytest plugin by ``tests/conftest.py``: the ``broker`` and ``subscriber`` fixtures are everyone's.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field

import paho.mqtt.client as mqtt
import pytest


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


@dataclass
class Broker:
    """A mosquitto process; ``stop`` and ``start`` again on the same port (no persistence)."""

    port: int
    config: str
    host: str = "127.0.0.1"
    process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["mosquitto", "-c", self.config], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection((self.host, self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"mosquitto did not listen on port {self.port}")

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass
class Subscriber:
    """Everything published under ``topic`` while it listens (it reconnects and subscribes again by itself)."""

    port: int
    host: str = "127.0.0.1"
    topic: str = "mpiscale/#"
    messages: list[tuple[str, dict, bool]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
        self.client.on_connect = lambda client, *_: client.subscribe(self.topic, qos=1)
        self.client.on_message = self._heard
        self.client.reconnect_delay_set(0.1, 0.5)
        self.client.connect_async(self.host, self.port)
        self.client.loop_start()

    def _heard(self, client, userdata, message) -> None:
        if message.topic.endswith("/control"):  # what others send the jobs: not a record
            return
        with self._lock:
            self.messages.append((message.topic, json.loads(message.payload), bool(message.retain)))

    def payloads(self, kind: str | None = None) -> list[dict]:
        with self._lock:
            return [payload for _, payload, _ in self.messages if kind is None or payload.get("kind") == kind]

    def wait_for(self, test, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for payload in self.payloads():
                if test(payload):
                    return payload
            time.sleep(0.05)
        raise AssertionError(f"no such record within {timeout}s; heard {len(self.messages)}: {self.payloads()[-5:]}")

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def start_broker(directory, security: str = "allow_anonymous true\n", host: str = "127.0.0.1") -> Broker:
    """A mosquitto on a free port of ``host`` (loopback), its configuration in ``directory``; ``security`` holds the
    lines of its access settings (files it names are read as root: mosquitto keeps the user that started it)."""
    if shutil.which("mosquitto") is None:
        pytest.skip("mosquitto is not installed (launch/setup.sh installs it)")
    port = free_port(host)
    config = directory / "mosquitto.conf"
    user = "user root\n" if os.geteuid() == 0 else ""
    config.write_text(f"listener {port} {host}\n{security}persistence false\n{user}")
    running = Broker(port, str(config), host)
    running.start()
    return running


@pytest.fixture
def broker(tmp_path):
    running = start_broker(tmp_path)
    yield running
    running.stop()


@pytest.fixture
def subscriber(broker):
    listening = Subscriber(broker.port)
    yield listening
    listening.close()
