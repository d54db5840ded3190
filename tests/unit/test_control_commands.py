"""Control messages as people and scripts send them: the commands a job obeys, and the reason for each refusal."""

import json

import pytest

from mpiscale.telemetry import problems, record, token
from mpiscale.telemetry.control import Command, Rejected, parse
from mpiscale.telemetry.settings import TelemetrySettings

TOKEN = "s3cret-token"


def test_commands_parse():
    assert parse(b'{"id": "a1", "command": "stop", "token": "s3cret-token"}', TOKEN) == Command("a1", "stop")
    message = {"command": "log-level", "level": "DEBUG", "id": "x", "token": TOKEN}
    assert parse(json.dumps(message).encode(), TOKEN) == Command("x", "log-level", "DEBUG")


@pytest.mark.parametrize(
    "given, job_token",
    [
        (None, TOKEN),
        ("", TOKEN),
        ("s3cret-toke", TOKEN),
        (TOKEN + "n", TOKEN),
        (7, TOKEN),
        (["s3cret-token"], TOKEN),
        (TOKEN, None),
    ],  # fmt: skip
)
def test_a_command_without_the_jobs_token_is_rejected(given, job_token):
    message = {"id": "a1", "command": "stop"} | ({} if given is None else {"token": given})
    with pytest.raises(Rejected, match="no token or not this job's") as refused:
        parse(json.dumps(message).encode(), job_token)
    assert refused.value.id == "a1"


def test_the_token_file_is_the_users_alone_and_names_any_job(tmp_path):
    env = {"MPISCALE_TOKEN_DIR": str(tmp_path / "jobs")}
    first = token.issue("alice/7", env)
    path = token.token_path("alice/7", env)
    assert path == tmp_path / "jobs" / "alice%2F7.token" and path.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "jobs").stat().st_mode & 0o777 == 0o700
    assert token.read("alice/7", env) == first and len(first) >= 32
    second = token.issue("alice/7", env)  # a requeued run: a new token, in the same file
    assert second != first and token.read("alice/7", env) == second
    assert token.read("alice/7", {**env, "MPISCALE_CONTROL_TOKEN": "chosen"}) == "chosen"
    assert token.issue("alice/8", {**env, "MPISCALE_CONTROL_TOKEN": "chosen"}) == "chosen"
    with pytest.raises(FileNotFoundError):
        token.read("bob/1", env)


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
        parse(raw, TOKEN)
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


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("MPISCALE_HANG_AFTER_S", "nan", "MPISCALE_HANG_AFTER_S a number > 0"),  # was accepted: no hang ever found
        ("MPISCALE_HANG_AFTER_S", "0", "MPISCALE_HANG_AFTER_S a number > 0"),
        ("MPISCALE_TELEMETRY_INTERVAL_S", "nan", "a finite number > 0"),
        ("MPISCALE_TELEMETRY_INTERVAL_S", "inf", "a finite number > 0"),
        ("MPISCALE_BROKER", "host:", "expected HOST:PORT, or HOST for port 1883"),
    ],
)
def test_settings_that_would_never_report_are_refused(variable, value, message):
    from mpiscale.telemetry import WatchdogSettings

    with pytest.raises(ValueError, match=message):
        (WatchdogSettings if "HANG" in variable else TelemetrySettings).from_env({variable: value})


@pytest.mark.parametrize(
    ("given", "address", "shown"),
    [
        ("::1", ("::1", 1883), "[::1]:1883"),  # was host ':', port 1
        ("[::1]", ("::1", 1883), "[::1]:1883"),
        ("[fd00::5]:8883", ("fd00::5", 8883), "[fd00::5]:8883"),  # was host '[fd00::5]', which no resolver takes
        ("10.0.0.7:1884", ("10.0.0.7", 1884), "10.0.0.7:1884"),
        ("broker.example.org:1884", ("broker.example.org", 1884), "broker.example.org:1884"),
    ],
)
def test_a_broker_is_named_by_host_ipv4_or_ipv6_address_with_or_without_a_port(given, address, shown):
    settings = TelemetrySettings.from_env({"MPISCALE_BROKER": given})
    assert settings.broker == address and settings.broker_shown == shown


@pytest.mark.parametrize("given", ["[::1]:", "[::1]x", "[::1", "[broker.example.org]:1883", "[]:1883", "[::1]:0"])
def test_a_bracketed_broker_address_that_is_not_ipv6_with_a_port_is_refused(given):
    with pytest.raises(ValueError, match=r"an IPv6 address in brackets when a port follows: \[::1\]:1883"):
        TelemetrySettings.from_env({"MPISCALE_BROKER": given})


def test_a_broker_named_without_a_port_is_port_1883_as_the_docs_say():
    from mpiscale.telemetry import WatchdogSettings

    assert TelemetrySettings.from_env({"MPISCALE_BROKER": "broker.example.org"}).broker == ("broker.example.org", 1883)
    assert WatchdogSettings.from_env({"MPISCALE_HANG_AFTER_S": "inf"}).hang_after_s == float("inf")  # never
