"""``mpiscale control``: send a command to a running job and wait for its answers on the job's events."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable

from ..errors import MpiscaleError
from .control import Command
from .settings import TelemetrySettings
from .sinks import mqtt_client, topic
from .token import read


class JobEnded(MpiscaleError, RuntimeError):
    """The job's retained status says it is no longer running."""


class NoToken(MpiscaleError, RuntimeError):
    """The job's control token cannot be read here; the message says where it was looked for."""


def job_token(job: str) -> str:
    """``job``'s control token, or NoToken saying why not."""
    try:
        return read(job)
    except OSError as error:
        raise NoToken(f"no control token for job {job} ({error.strerror}: {error.filename}); the job writes it at "
                      "its start, readable by its user only: run this as that user, on a host that shares the job's "
                      "home, or set MPISCALE_CONTROL_TOKEN to it") from None  # fmt: skip


async def send_command(
    settings: TelemetrySettings,
    job: str,
    command: Command,
    timeout_s: float,
    say: Callable[[str], None] = print,
) -> bool:
    """Publish ``command`` with the job's token to ``job``'s control topic once its status says it runs; True once
    the job completed it, False if it rejected it.

    The token is read then (a job writes it as it starts): NoToken when it cannot be.

    Raises JobEnded when the job's status says it ended, TimeoutError when no
    final answer came within ``timeout_s``.
    """
    async with mqtt_client(settings, f"mpiscale-control-{uuid.uuid4().hex[:8]}") as client:
        for kind in ("status", "event"):  # before publishing: no answer is missed
            await client.subscribe(topic(job, kind), qos=1)
        message: dict[str, str] = {"id": command.id, "command": command.command}
        message |= {"level": command.level} if command.level else {}
        sent = False
        async with asyncio.timeout(timeout_s):
            async for received in client.messages:
                try:
                    record = json.loads(bytes(received.payload))
                except ValueError:
                    continue
                if not isinstance(record, dict):
                    continue
                if record.get("kind") == "status" and not sent:  # the job listens once it has said it runs
                    if record.get("state") != "running":
                        raise JobEnded(f"job {job} has ended ({record.get('state')})")
                    message["token"] = job_token(job)
                    await client.publish(topic(job, "control"), json.dumps(message).encode(), qos=1)
                    sent = True
                    say(f"sent {command.command} (id {command.id}) to job {job}")
                elif record.get("kind") == "event" and record.get("id") == command.id:
                    say(f"{record['event']}: {record.get('detail', '')}")
                    if record["event"] in ("completed", "rejected"):
                        return record["event"] == "completed"
    raise ConnectionError("the broker ended the connection")


def new_id() -> str:
    """A command id nobody else will use."""
    return uuid.uuid4().hex[:12]
