"""Remote control of running jobs through a real mosquitto: stop, a flood of malformed commands, another job's
topic, and a broker with passwords, TLS and the documented ACL."""

import json
import os
import ssl
import subprocess
import sys
import time

import h5py
import numpy as np
import paho.mqtt.client as mqtt
from helpers import assert_ok, finish, launch
from mqtt_broker import start_broker

from mpiscale.telemetry import problems, read_token

MPISCALE = [sys.executable, "-m", "mpiscale.cli"]
KSVD = ["--atoms", "50", "--sparsity", "3", "--samples", "1500", "--features", "20", "--snr-db", "20"]
FLOOD = [
    b"",
    b"stop",
    b"\xff\xfe",
    b"[" * 2000 + b"]" * 2000,  # deeper than the JSON parser's recursion allows
    b"[1, 2]",
    b'{"command": "stop"}',  # no id
    b'{"id": 7, "command": "stop"}',
    b'{"id": "x", "command": "reboot"}',
    b'{"id": "x", "command": "log-level", "level": "LOUD"}',
    b'{"id": "x", "command": "stop", "delay": 5}',
    b'{"id": "' + b"x" * 100 + b'", "command": "stop"}',
    b'{"id": "x", "command": "stop", "pad": "' + b"x" * 5000 + b'"}',
]


def dictlearn(ranks, out, *options, env=None):
    command = [*MPISCALE, "dictlearn", "--out", str(out), "--progress-every", "0", *KSVD, *options]
    return launch(ranks, command, env=env)


def control(job, *command, env=None, timeout=60):
    arguments = [*MPISCALE, "control", job, *command, "--timeout", str(timeout)]
    return subprocess.run(arguments, capture_output=True, text=True, timeout=timeout + 30, env=env)


def learned(out):
    with h5py.File(out, "r") as file:
        return file["dictionary"][()], file.attrs["stop_reason"], int(file.attrs["iterations"])


def test_stop_checkpoints_and_exits_0_and_the_run_resumes_as_if_never_stopped(broker, subscriber, tmp_path):
    """Malformed commands flood the job and a stop goes to another job's topic: the job answers each rejection,
    ignores the other topic, and goes on; then `mpiscale control ... stop` checkpoints it and it exits 0. Resumed
    on 4 ranks, it ends with the dictionary of an uninterrupted run on 3."""
    env = {"MPISCALE_BROKER": broker.address, "MPISCALE_JOB_ID": "c1", "MPISCALE_TELEMETRY_INTERVAL_S": "0.5"}
    options = ["--checkpoint-every", "1000"]
    job = dictlearn(2, tmp_path / "a.h5", *options, "--iterations", "1000000", env=env)
    subscriber.wait_for(lambda p: p["kind"] == "progress" and p["step"] >= 20, timeout=120)
    subscriber.client.publish("mpiscale/c2/control", json.dumps({"id": "other", "command": "stop"}), qos=1)
    for i in range(500):  # within mosquitto's queue of 1,000 for one subscriber
        subscriber.client.publish("mpiscale/c1/control", FLOOD[i % len(FLOOD)], qos=1)

    def rejections():
        answers = [p for p in subscriber.payloads("event") if p["event"] == "rejected"]
        more = [int(p["detail"].split()[0]) for p in answers if "more control messages rejected" in p["detail"]]
        return len(answers) - len(more) + sum(more)

    subscriber.wait_for(lambda _: rejections() == 500, timeout=60)
    # well-formed commands without the job's token (on a broker without ACLs, anyone's): rejected, the job runs on
    token = read_token("c1")
    for id, given in (("bare", {}), ("wrong", {"token": token[:-1] + "?"})):
        subscriber.client.publish("mpiscale/c1/control", json.dumps({"id": id, "command": "stop", **given}), qos=1)
        refused = subscriber.wait_for(lambda p, id=id: p["kind"] == "event" and p.get("id") == id, timeout=30)
        assert refused["event"] == "rejected" and "no token or not this job's" in refused["detail"], refused
    assert job.poll() is None
    elsewhere = control("c1", "stop", "--broker", broker.address, env={**os.environ, "MPISCALE_TOKEN_DIR": "/nowhere"})
    assert elsewhere.returncode == 2, elsewhere.stdout + elsewhere.stderr
    assert "no control token for job c1 (No such file or directory: /nowhere/c1.token)" in elsewhere.stderr
    impostor = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="mpiscale-c1")  # the id jobs once used
    impostor.connect("127.0.0.1", broker.port)
    impostor.loop_start()
    time.sleep(1.0)
    stopped = control("c1", "stop", "--broker", broker.address)
    impostor.loop_stop()
    impostor.disconnect()
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert "acknowledged: stop" in stopped.stdout and "completed: stopped after iteration" in stopped.stdout
    done = finish(job, "dictlearn stopped by a control command", 60)
    assert_ok(done)
    assert "stopped on request (a stop command or SIGTERM) after iteration" in done.stdout
    _, reason, step = learned(tmp_path / "a.h5")
    assert reason == "stopped" and step > 20
    assert f"completed: stopped after iteration {step}, after its checkpoint" in stopped.stdout
    assert int((tmp_path / "a.checkpoints" / "latest").read_text()) == step
    subscriber.wait_for(lambda p: p["kind"] == "status" and p["state"] == "stopped", timeout=10)
    answers = subscriber.payloads("event")
    assert all(not problems(p) for p in subscriber.payloads()), [problems(p) for p in subscriber.payloads()]
    assert not [p for p in answers if p.get("id") == "other"]
    shown = [p["detail"] for p in answers if p["event"] == "rejected"]
    assert any("not JSON" in d for d in shown) and any("unknown command 'reboot'" in d for d in shown), shown
    assert any("more control messages rejected" in d for d in shown), shown
    assert any("nested too deeply" in d for d in shown), shown
    states = [p["state"] for p in subscriber.payloads("status")]
    assert "lost" not in states, states  # the impostor took no session of the job's

    total = str(step + 30)
    resumed = finish(dictlearn(4, tmp_path / "a.h5", *options, "--iterations", total, "--resume"), "resume", 120)
    assert_ok(resumed)
    assert f"resumed from the checkpoint of iteration {step}" in resumed.stdout
    assert_ok(finish(dictlearn(3, tmp_path / "b.h5", *options, "--iterations", total), "uninterrupted", 240))
    (a, reason, _), (b, _, _) = learned(tmp_path / "a.h5"), learned(tmp_path / "b.h5")
    assert reason == "iterations" and np.abs(a - b).max() < 1e-9


def tls_files(directory):
    """A CA, and a certificate for 127.0.0.1 signed by it (as a site's broker would have)."""

    def openssl(*arguments):
        subprocess.run(["openssl", *arguments], cwd=directory, check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
            "-subj", "/CN=mpiscale test CA")  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
            "-subj", "/CN=127.0.0.1")  # fmt: skip
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "server.pem", "-days", "1", "-extfile", "san.ext")  # fmt: skip


def test_passwords_tls_and_the_acl_let_a_user_control_only_their_own_jobs(tmp_path):
    """The broker of docs/telemetry.md: TLS, passwords, and its ACL (everyone reads, each user writes only under
    `mpiscale/<user>/`). Bob cannot stop
    Alice's job (the broker drops his command, and he hears no answer); Alice can; a wrong password costs the
    job its telemetry, not its run."""
    tls_files(tmp_path)
    passwords = tmp_path / "passwd"
    for user, password in (("alice", "alice-secret"), ("bob", "bob-secret")):
        create = ["-c"] if not passwords.exists() else []
        subprocess.run(["mosquitto_passwd", *create, "-b", str(passwords), user, password], check=True, timeout=30)
    (tmp_path / "acl").write_text("pattern read mpiscale/#\npattern readwrite mpiscale/%u/#\n")  # as in the docs
    files = {"password_file": passwords, "acl_file": tmp_path / "acl", "cafile": tmp_path / "ca.pem",
             "certfile": tmp_path / "server.pem", "keyfile": tmp_path / "server.key"}  # fmt: skip
    security = "allow_anonymous false\n" + "".join(f"{name} {path}\n" for name, path in files.items())
    broker = start_broker(tmp_path, security)
    try:
        common = {"MPISCALE_BROKER": broker.address, "MPISCALE_BROKER_CA": str(tmp_path / "ca.pem")}
        alice = {**common, "MPISCALE_BROKER_USER": "alice", "MPISCALE_BROKER_PASSWORD": "alice-secret"}
        bob = {**common, "MPISCALE_BROKER_USER": "bob", "MPISCALE_BROKER_PASSWORD": "bob-secret"}
        command = [*MPISCALE, "memstore", "--records", "20000", "--out"]
        job = launch(2, [*command, str(tmp_path / "m.h5"), "--iterations", "1000000"],
                     env={**alice, "MPISCALE_JOB_ID": "alice/7"})  # fmt: skip
        dumped = control("alice/7", "dump", env={**os.environ, **alice})  # sent once the job says it runs
        assert dumped.returncode == 0 and "completed: every rank of 2" in dumped.stdout, dumped.stderr
        watched = subprocess.run([*MPISCALE, "watch", "alice/7", "--timeout", "3"], capture_output=True,
                                 text=True, timeout=30, env={**os.environ, **bob})  # fmt: skip
        assert "alice/7" in watched.stdout and "running" in watched.stdout, watched.stdout + watched.stderr
        publish_as("bob", "bob-secret", broker.port, tmp_path / "ca.pem", "mpiscale/alice/7/control",
                   {"id": "bob-1", "command": "stop"})  # fmt: skip
        time.sleep(3)  # the job agrees on requests every 0.2 s: a stop that got through would have ended it
        assert job.poll() is None, "bob stopped alice's job"
        refused = control("alice/7", "stop", env={**os.environ, **bob}, timeout=5)
        assert refused.returncode == 1 and "no answer from job alice/7" in refused.stderr
        stopped = control("alice/7", "stop", env={**os.environ, **alice})
        assert stopped.returncode == 0 and "completed: stopped after iteration" in stopped.stdout, stopped.stderr
        assert_ok(finish(job, "memstore stopped by its owner", 60))
        ended = control("alice/7", "dump", env={**os.environ, **alice})
        assert ended.returncode == 1 and "job alice/7 has ended (stopped)" in ended.stderr
        wrong = {**alice, "MPISCALE_BROKER_PASSWORD": "guess", "MPISCALE_JOB_ID": "alice/8"}
        short = [*command, str(tmp_path / "w.h5"), "--iterations", "200"]
        refused_password = finish(launch(2, short, env=wrong), "memstore with a refused password", 120)
        assert_ok(refused_password)
        assert refused_password.stderr.count("telemetry: cannot connect to the broker") == 1, refused_password.stderr
        outside = finish(launch(2, short, env={**alice, "MPISCALE_JOB_ID": "7"}), "a job outside its ACL", 120)
        assert_ok(outside)  # its publishes refused (MPISCALE_JOB_ID not under alice/): said once, the job runs on
        assert outside.stderr.count("the broker") == 1, outside.stderr
        assert "refuses this job's publishes under mpiscale/7/ (Not authorized)" in outside.stderr, outside.stderr
        assert "MPISCALE_JOB_ID=alice/<id>" in outside.stderr
        no_ca = {**alice, "MPISCALE_BROKER_CA": str(tmp_path / "missing.pem"), "MPISCALE_JOB_ID": "alice/9"}
        missing_ca = finish(launch(2, short, env=no_ca), "memstore with a missing CA file", 120)
        assert_ok(missing_ca)
        assert "telemetry: cannot connect to the broker" in missing_ca.stderr and "missing.pem" in missing_ca.stderr
    finally:
        broker.stop()


def publish_as(user, password, port, ca, topic, message):
    """One message published over TLS with a user's password, as any MQTT client would."""
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
    client.username_pw_set(user, password)
    client.tls_set(ca_certs=str(ca), cert_reqs=ssl.CERT_REQUIRED)
    client.connect("127.0.0.1", port)
    client.loop_start()
    try:
        client.publish(topic, json.dumps(message), qos=1).wait_for_publish(timeout=10)
    finally:
        client.loop_stop()
        client.disconnect()


def test_a_broker_that_takes_the_status_and_refuses_the_rest_is_named_once(tmp_path):
    """An ACL that lets the job write its retained status and nothing else: the other records went at QoS 0, which
    the broker drops without a word, and 59 publishes were refused with nothing said (issue 59, item 14)."""
    (tmp_path / "acl").write_text("topic read mpiscale/#\ntopic write mpiscale/7/status\n")
    broker = start_broker(tmp_path, f"allow_anonymous true\nacl_file {tmp_path / 'acl'}\n")
    try:
        env = {"MPISCALE_BROKER": broker.address, "MPISCALE_JOB_ID": "7"}
        command = [*MPISCALE, "memstore", "--records", "20000", "--out", str(tmp_path / "m.h5"), "--iterations", "200"]
        job = finish(launch(2, command, env=env), "a job whose records but the status are refused", 120)
        assert_ok(job)
        assert job.stderr.count("the broker") == 1, job.stderr
        assert "refuses this job's publishes under mpiscale/7/ (Not authorized)" in job.stderr, job.stderr
    finally:
        broker.stop()
