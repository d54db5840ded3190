"""Control messages as people and scripts send them: the commands a job obeys, and the reason for each refusal."""

import json

import pytest

from mpiscale.telemetry import problems, record
from mpiscale.telemetry.control import Command, Rejected, parse
from mpiscale.telemetry.settings import TelemetrySettings


def test_commands_parse():
    assert parse(b'{"id": "a1", "command": "stop"}') == Command("a1", "stop")
    assert parse(json.dumps({"command": "log-level", "level": "DEBUG", "id": "x"}).encode()) == Command(
        "x", "log-level", "DEBUG"
    )


@pytest.mark.parametrize(
    "raw, reason, id",
    [
        (b"stop", "not JSON", None),
        (b"[" * 2000 + b"]" * 2000, "nested too deeply", None),
        (b"\xff", "not JSON", None),
        (b"[]", "a JSON object, got list", None),
        (b'{"command": "stop"}', "id must be a string", None),
        (b'{"id": "", "command": "stop"}', "id must be a string", None),
        (b'{"id": 3, "command": "stop"}', "id must be a string", None),
        (b'{"id": "a", "command": "Stop"}', "unknown command 'Stop'", "a"),
        (b'{"id": "a", "command": "log-level"}', "log-level needs level", "a"),
        (b'{"id": "a", "command": "stop", "after": 3}', "unknown fields ['after']", "a"),
        (b'{"id": "a", "command": "stop", "x": "' + b"y" * 5000 + b'"}', "at most 4096 bytes", None),
    ],
)
def test_malformed_messages_are_rejected_with_a_reason(raw, reason, id):
    with pytest.raises(Rejected, match=reason.replace("[", r"\[").replace("]", r"\]")) as refused:
        parse(raw)
    assert refused.value.id == id and len(str(refused.value)) <= 200


def test_answers_follow_the_schema():
    assert not problems(record("event", "j", event="rejected", rank=0, detail="not JSON", id=None))
    assert not problems(record("event", "j", event="completed", rank=0, detail="stopped", id="a1"))
    assert problems(record("event", "j", event="completed", rank=0, detail="stopped"))  # an answer needs its id


@pytest.mark.parametrize("job", ["alice/#", "a+b", "/alice/7", "alice/", "alice//7", "a\0b", "x" * 201])
def test_a_job_id_that_cannot_name_mqtt_topics_is_refused(job):
    with pytest.raises(ValueError, match="a job id names MQTT topics"):
        TelemetrySettings.from_env({"MPISCALE_JOB_ID": job})
    assert TelemetrySettings.from_env({"MPISCALE_JOB_ID": "alice/4242_3"}).enabled
