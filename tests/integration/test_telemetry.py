"""Telemetry to a real mosquitto broker: records that follow the schema, the retained status and the last will,
a broker that is away at the start or restarted mid-run, and the JSON-lines file when there is no broker."""

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
from helpers import MPIRUN_GRACE, assert_ok, ended_after, finish, launch, start_mpi
from mqtt_broker import Subscriber, free_port, start_broker

from mpiscale.telemetry import TelemetrySettings, problems, record, sinks
from mpiscale.telemetry.sinks import MqttSink, lost_status
from mpiscale.telemetry.watch import GONE_AFTER_S

MPISCALE = [sys.executable, "-m", "mpiscale.cli"]


def memstore(ranks, out, *args, env=None, options=()):
    command = [*MPISCALE, "memstore", "--records", "100000", "--out", str(out), *map(str, args)]
    environment = {"MPISCALE_TELEMETRY_INTERVAL_S": "0.2", **(env or {})}
    return launch(ranks, command, env=environment, options=options)


def test_a_job_publishes_records_that_follow_the_schema(broker, subscriber, tmp_path):
    env = {"MPISCALE_BROKER": broker.address, "MPISCALE_JOB_ID": "t1"}
    durable = ("--checkpoint-dir", tmp_path / "ck", "--checkpoint-every", 150)
    watcher = subprocess.Popen([*MPISCALE, "watch", "t1", "--broker", broker.address, "--timeout", "120"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    job = memstore(3, tmp_path / "m.h5", "--iterations", 400, *durable, env=env, options=("--ranks-per-node", "2"))
    assert_ok(finish(job, "memstore with telemetry", 180))
    subscriber.wait_for(lambda p: p["kind"] == "status" and p["state"] == "finished")
    records = subscriber.payloads()
    assert all(not problems(payload) for payload in records), [problems(p) for p in records if problems(p)]
    assert {p["kind"] for p in records} == {"status", "progress", "metrics", "event", "heartbeat"}
    assert all(topic == f"mpiscale/t1/{p['kind']}" for topic, p, _ in subscriber.messages)
    events = [p["event"] for p in subscriber.payloads("event")]
    assert events[0] == "started" and events[-1] == "finished" and events.count("checkpoint") == 2, events
    last = subscriber.payloads("metrics")[-1]
    assert last["ranks_reporting"] == 3 and last["values"]["step"]["min"] == 400
    assert subscriber.payloads("progress")[-1]["step"] == 400
    shown, errors = watcher.communicate(timeout=60)
    assert watcher.returncode == 0, errors
    assert "job t1: memstore on 3 ranks" in shown and "finished" in shown and "] 400/400" in shown, shown[-3000:]
    assert "rank 0: finished memstore" in shown and "finished memstore finished" not in shown, shown[-3000:]
    late = Subscriber(broker.port)  # joins after the job: the retained status says how it ended
    try:
        status = late.wait_for(lambda p: p["kind"] == "status", timeout=10)
        assert status["state"] == "finished" and late.messages[0][2]
    finally:
        late.close()


def test_a_broker_on_an_ipv6_address_is_reached_by_the_job_and_its_watcher(tmp_path):
    try:
        free_port("::1")
    except OSError:
        pytest.skip("this machine has no IPv6 loopback")
    broker = start_broker(tmp_path, host="::1")
    listening = Subscriber(broker.port, host="::1")
    try:
        watcher = subprocess.Popen([*MPISCALE, "watch", "t6", "--broker", broker.address, "--timeout", "120"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        env = {"MPISCALE_BROKER": broker.address, "MPISCALE_JOB_ID": "t6"}  # [::1]:PORT, as a user writes it
        assert_ok(finish(memstore(2, tmp_path / "m.h5", "--iterations", 50, env=env), "memstore to [::1]", 120))
        listening.wait_for(lambda p: p["kind"] == "status" and p["state"] == "finished")
        shown, errors = watcher.communicate(timeout=60)
        assert watcher.returncode == 0 and "finished" in shown, errors
    finally:
        listening.close()
        broker.stop()


def test_a_killed_job_shows_as_lost(broker, subscriber, tmp_path):
    """Rank 0 (the publisher) SIGKILLed mid-run, alone (no rank remains to report in its place, as on 2 ranks): the
    broker sends the job's last will, retained. (Killed in iteration 3,000, two busy loops beside it, the job outran
    the watch's 120 s: 32 steps/s.)"""
    env = {"MPISCALE_BROKER": broker.address, "MPISCALE_JOB_ID": "t2",
           "MPISCALE_REHEARSE_FAILURE": "rank=0,iteration=300"}  # fmt: skip
    watcher = subprocess.Popen([*MPISCALE, "watch", "t2", "--broker", broker.address, "--timeout", "240"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    job = memstore(1, tmp_path / "m.h5", "--iterations", 100000, env=env)
    finished = finish(job, "memstore killed", 180)
    assert finished.returncode == 137, finished.output[-3000:]
    subscriber.wait_for(lambda p: p["kind"] == "status" and p["state"] == "running")
    lost = subscriber.wait_for(lambda p: p["kind"] == "status" and p["state"] == "lost", timeout=20)
    assert not problems(lost) and lost["job"] == "t2"
    # watch shows the heartbeat missing (it redraws without new records), waits for the lost job, then gives up
    shown, errors = watcher.communicate(timeout=60)
    assert watcher.returncode == 1, shown[-2000:] + errors
    assert "NO HEARTBEAT for " in shown and "watching for it to come back" in shown, shown[-3000:]
    assert "mpiscale watch: the job (lost) has said nothing for " in errors, errors


def test_a_watch_held_past_the_silence_limit_reads_the_queued_records_before_judging(broker, tmp_path):
    """The watch suspended (Ctrl-Z; or its output piped to a reader that stopped) for longer than a job may be
    silent: when it runs again it reads the records queued meanwhile and goes on watching a job that is alive. It
    used to compare the first stale record with the clock and call the job gone (the suite's piped watch did)."""
    job = memstore(1, tmp_path / "m.h5", "--iterations", 10**7,
                   env={"MPISCALE_BROKER": broker.address, "MPISCALE_JOB_ID": "t14"})  # fmt: skip
    shown_path = tmp_path / "watch.out"
    try:
        with open(shown_path, "w") as shown_file:
            watcher = subprocess.Popen([*MPISCALE, "watch", "t14", "--broker", broker.address, "--timeout", "300"],
                                       stdout=shown_file, stderr=subprocess.PIPE, text=True)  # fmt: skip
        deadline = time.monotonic() + 120
        while "] " not in shown_path.read_text() and watcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)  # a step reported: heartbeats come
        watcher.send_signal(signal.SIGSTOP)
        time.sleep(GONE_AFTER_S + 3)
        watcher.send_signal(signal.SIGCONT)
        time.sleep(3)
        watching = watcher.poll() is None
    finally:  # the job ends on request whatever happened
        watcher.send_signal(signal.SIGCONT)
        stop = subprocess.run([*MPISCALE, "control", "t14", "stop", "--broker", broker.address, "--timeout", "60"],
                              capture_output=True, text=True, timeout=90)  # fmt: skip
        done = finish(job, "memstore watched by a suspended watch", 120)
    _, errors = watcher.communicate(timeout=60)
    assert watching and watcher.returncode == 0, shown_path.read_text()[-2000:] + errors
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert_ok(done)


def test_a_dead_rank_is_named_by_a_failure_event(broker, subscriber, tmp_path):
    """Rank 1 killed by the rehearsal mid-run: mpirun's SIGTERM reaches rank 0, which finds rank 1's process gone and
    names it, as planned, in a failure event. The output holds one line for the one failure, the dying rank's: rank
    0 and the launcher used to add two more, the launcher's blaming the out-of-memory killer."""
    env = {"MPISCALE_BROKER": broker.address, "MPISCALE_JOB_ID": "t5",
           "MPISCALE_REHEARSE_FAILURE": "rank=1,iteration=3000", **MPIRUN_GRACE}  # fmt: skip
    job = memstore(2, tmp_path / "m.h5", "--iterations", 100000, env=env)
    finished = finish(job, "memstore with rank 1 killed", 180)
    assert finished.returncode != 0
    failure = subscriber.wait_for(lambda p: p["kind"] == "event" and p["event"] == "failure", timeout=20)
    assert not problems(failure) and failure["rank"] == 1, failure
    assert re.fullmatch(r"rank 1 \(pid \d+\) on host \S+ ended as planned \(killed by MPISCALE_REHEARSE_FAILURE in "
                        r"iteration 3000\); the job cannot go on", failure["detail"]), failure  # fmt: skip
    status = subscriber.wait_for(lambda p: p["kind"] == "status" and p["state"] != "running", timeout=20)
    assert status["state"] == "failed", status
    # (telemetry's straggler warning is no line about the failure: it is true, and may come, where another test's
    # ranks share the cores and slow rank 1 down; a quiet suite run saw it once)
    said = [line for line in finished.stderr.splitlines() if line.strip() and "telemetry: straggler:" not in line]
    assert len(said) == 1 and said[0].startswith("mpiscale: rehearsal: rank 1 is killed in iteration 3000"), said


def test_a_broker_away_at_the_start_and_restarted_mid_run(broker, subscriber, tmp_path):
    """The job starts while the broker is down, the broker comes up, goes away and comes back: publishing resumes
    after each return, and the job still obeys its control topic. The test ends the job with ``stop`` once it
    has seen it all, so that no timing decides whether the job outlives the broker's absence."""
    broker.stop()
    job = memstore(2, tmp_path / "m.h5", "--iterations", 10**7,
                   env={"MPISCALE_BROKER": broker.address, "MPISCALE_JOB_ID": "t3"})  # fmt: skip
    try:
        time.sleep(2)
        broker.start()
        subscriber.wait_for(lambda p: p["kind"] == "progress", timeout=60)
        shown_path = tmp_path / "watch.out"
        with open(shown_path, "w") as shown_file:
            watcher = subprocess.Popen([*MPISCALE, "watch", "t3", "--broker", broker.address, "--timeout", "120"],
                                       stdout=shown_file, stderr=subprocess.PIPE, text=True)  # fmt: skip
        deadline = time.monotonic() + 60  # the watcher has seen the job (on a loaded machine its start takes seconds)
        while "job t3:" not in shown_path.read_text() and watcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        broker.stop()
        time.sleep(1.5)
        heard = len(subscriber.messages)
        broker.start()
        subscriber.wait_for(lambda p: p["kind"] == "heartbeat" and len(subscriber.messages) > heard + 3, timeout=60)
        subscriber.wait_for(lambda p: p["kind"] == "status" and p["state"] == "running")
        stop = subprocess.run([*MPISCALE, "control", "t3", "stop", "--broker", broker.address, "--timeout", "60"],
                              capture_output=True, text=True, timeout=90)  # fmt: skip
        assert stop.returncode == 0, stop.stdout + stop.stderr
    finally:
        done = finish(job, "memstore through broker restarts", 120)
    assert_ok(done)
    status = subscriber.wait_for(lambda p: p["kind"] == "status" and p["state"] == "stopped", timeout=20)
    assert not problems(status)
    steps = [p["step"] for p in subscriber.payloads("progress")]
    assert steps == sorted(steps) and 0 < steps[-1] < 10**7, steps[-5:]
    _, errors = watcher.communicate(timeout=60)  # it connected again and saw the job to its end
    shown = shown_path.read_text()
    assert watcher.returncode == 0, shown[-2000:] + errors
    assert "mpiscale watch: lost the broker (" in errors and "; connecting again" in errors, errors
    assert "job t3: memstore on 2 ranks" in shown and "stopped" in shown, shown[-2000:]


def test_a_job_ending_while_the_sink_waits_to_reconnect_still_sends_its_last_records(broker, subscriber, monkeypatch):
    """The broker went away, the sink backs off for seconds (the first backoff made long here, so that no lucky
    attempt can land in the end's short window), and the broker is back just as the job ends: the end cuts the
    backoff short, so the final status arrives instead of a stale ``running``."""
    monkeypatch.setattr(sinks, "BACKOFF_FIRST_S", 10.0)

    async def scenario() -> float:
        settings = TelemetrySettings(broker=("127.0.0.1", broker.port))
        sink = MqttSink(settings, "t7", lost_status("t7", "memstore", 1, "here"), on_control=lambda _: None)
        sink.publish(record("status", "t7", state="running", command="memstore", ranks=1, host="here"), retain=True)
        while not sink.connected:
            await asyncio.sleep(0.05)
        broker.stop()
        while sink.connected:
            sink.publish(record("heartbeat", "t7", ranks_reporting=1, oldest_report_s=0.0, dropped=0))
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # failed once: the next attempt is 5 to 15 s away
        broker.start()
        sink.publish(record("status", "t7", state="finished", command="memstore", ranks=1, host="here"), retain=True)
        began = time.monotonic()
        await sink.close()
        return time.monotonic() - began

    closing_s = asyncio.run(scenario())
    finished = subscriber.wait_for(lambda p: p["kind"] == "status" and p["state"] == "finished", timeout=10)
    assert not problems(finished) and closing_s < sinks.CLOSE_UNCONNECTED_S, closing_s


def test_without_a_broker_the_records_go_to_a_file_beside_the_results(tmp_path):
    out = tmp_path / "m.h5"
    job = memstore(2, out, "--iterations", 300, env={"MPISCALE_JOB_ID": "t4"})
    done = finish(job, "memstore, telemetry to a file", 180)
    assert_ok(done)
    path = tmp_path / "m.h5.telemetry.jsonl"
    assert f"telemetry: job t4 -> {path}" in done.stdout
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records and all(not problems(p) for p in records)
    assert records[0]["kind"] == "status" and records[-1] == {**records[-1], "kind": "status", "state": "finished"}
    shown = subprocess.run([*MPISCALE, "watch", "--file", str(path)], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "] 300/300" in shown.stdout and "finished" in shown.stdout, shown.stdout


@pytest.mark.parametrize("ranks", [1, 2])
def test_watch_of_the_file_of_a_job_that_died_ends_saying_so(tmp_path, ranks):
    """Rank 0 killed: on 1 rank no final status ever comes, and watch --file ends once the job has said nothing for
    30 heartbeat intervals (here 0.2 s each); on 2, the rank that remains writes the failure and the failed status
    in rank 0's place (it wrote nothing before: issue 59, item 16)."""
    out = tmp_path / "m.h5"
    env = {"MPISCALE_JOB_ID": "t5", "MPISCALE_REHEARSE_FAILURE": "rank=0,iteration=3000", **MPIRUN_GRACE}
    finished = finish(memstore(ranks, out, "--iterations", 100000, env=env), "memstore killed", 180)
    assert finished.returncode == 137, finished.output[-3000:]
    shown = subprocess.run([*MPISCALE, "watch", "--file", f"{out}.telemetry.jsonl"], capture_output=True, text=True,
                           timeout=60)  # fmt: skip
    assert shown.returncode == 1, shown.stdout[-2000:] + shown.stderr
    if ranks == 1:
        assert "mpiscale watch: the job (running) has said nothing for " in shown.stderr, shown.stderr
        assert "it died without a final status, or its rank 0 is blocked" in shown.stderr
        return
    assert "mpiscale watch: the job ended failed" in shown.stderr, shown.stderr
    assert "failure rank 0 (pid " in shown.stdout and "MPISCALE_REHEARSE_FAILURE" in shown.stdout, shown.stdout[-2000:]


@pytest.mark.parametrize(
    "env, said",
    [({"MPISCALE_BROKER": "host:notaport"}, "MPISCALE_BROKER='host:notaport': expected HOST:PORT"),
     ({"MPISCALE_BROKER": f"{'a' * 64}:1883"}, "is not a host name: each part between dots holds 1 to 63 characters"),
     ({"MPISCALE_JOB_ID": "a+b", "MPISCALE_TELEMETRY": "0"}, "MPISCALE_JOB_ID='a+b': a job id names MQTT topics")],
    ids=["port", "host-label", "job-id"],
)  # fmt: skip
def test_malformed_telemetry_settings_are_refused_with_one_line_on_every_rank(tmp_path, env, said):
    """Refused at the start on every rank alike: one line and exit status 2, not a traceback from each rank (the
    job id was checked even with telemetry off), nor an error left in a background task (the host's label)."""
    job = memstore(2, tmp_path / "m.h5", "--iterations", 3, env=env)
    done = finish(job, "memstore with a bad telemetry setting", 120)
    assert done.returncode == 2 and said in done.stderr and done.stderr.count("\n") == 1, done.output[-3000:]
    assert not (tmp_path / "m.h5").exists()


def test_a_stuck_rank_is_named_every_rank_dumps_and_the_job_ends(tmp_path):
    """Rank 2, the first rank of the second of two simulated nodes, stops inside an iteration (its event loop
    blocked) while the others wait in a collective. Rank 3's reports go through rank 2, so they stop too: rank 3
    is listed behind rank 2, never named as hung itself. The job ends by the abort, long before rank 2's 120 s
    would (a job that waited for the hang to end would take more than 120 s). The hang came in iteration 1,000
    with a bound of 60 s, and a loaded run took 63 s: 4 ranks under load took most of a minute to get there. The
    watch waits 8 s: at 2 s it named rank 2 at step 0, still starting beside another test's ranks on the 2 cores,
    while the others already waited (the watch's rule, not the rehearsed hang; 2026-12-01)."""
    env = {"MPISCALE_JOB_ID": "t6", "MPISCALE_HANG_AFTER_S": "8", "MPISCALE_HANG_ACTION": "abort",
           "MPISCALE_RANKS_PER_NODE": "2", "MPISCALE_TELEMETRY_INTERVAL_S": "0.5",
           "MPISCALE_REHEARSE_FAILURE": "rank=2,iteration=300,hang=120"}  # fmt: skip
    started = time.monotonic()
    done = finish(memstore(4, tmp_path / "m.h5", "--iterations", 100000, env=env), "memstore with a hang", 150)
    assert done.returncode == 1 and time.monotonic() - started < 100, done.output[-4000:]
    assert "mpiscale: telemetry: hang: rank 2 (host" in done.stderr and "wait in collectives" in done.stderr
    assert "; ranks [3] report through it and are unseen since" in done.stderr, done.stderr[-4000:]
    assert "hang: rank 3" not in done.stderr and "RuntimeError: hang detected: rank 2" in done.stderr
    dumped = {rank for rank in range(4) if f"mpiscale diagnostics: rank {rank} of 4" in done.stderr}
    assert dumped == {0, 1, 3}, dumped  # the waiting ranks; rank 2's C-level stacks come from faulthandler
    assert "Current thread" in done.stderr or "Thread 0x" in done.stderr
    records = [json.loads(line) for line in (tmp_path / "m.h5.telemetry.jsonl").read_text().splitlines()]
    hangs = [p for p in records if p["kind"] == "event" and p["event"] == "hang"]
    assert len(hangs) == 1 and hangs[0]["rank"] == 2 and not problems(hangs[0])
    assert records[-1]["kind"] == "status" and records[-1]["state"] == "failed"


def read_records(path) -> list[dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records and all(not problems(p) for p in records), [problems(p) for p in records if problems(p)]
    return records


def test_a_users_own_job_on_the_runtime_is_watched_like_the_projects_jobs(tmp_path):
    """``mpiscale.run(main, name=...)`` of a user's script: the steps it reports with ``mpiscale.report_step`` reach
    the records during the run, and it ends with a finished status, in NAME.telemetry.jsonl where it ran."""
    env = {"MPISCALE_TELEMETRY": "1", "MPISCALE_JOB_ID": "t10", "MPISCALE_TELEMETRY_INTERVAL_S": "0.2"}
    done = finish(start_mpi("user_job.py", 2, "150", env=env, cwd=tmp_path), "a user's job with telemetry", 120)
    assert_ok(done)
    assert "telemetry: job t10 -> my-steps.telemetry.jsonl" in done.stdout
    records = read_records(tmp_path / "my-steps.telemetry.jsonl")
    assert records[0] == {**records[0], "kind": "status", "state": "running", "command": "my-steps", "ranks": 2}
    steps = [(p["step"], p["total"]) for p in records if p["kind"] == "progress"]
    assert steps[-1] == (150, 150) and any(0 < step < 150 for step, _ in steps), steps
    assert records[-1] == {**records[-1], "kind": "status", "state": "finished"}


def test_a_defect_in_the_hang_watch_ends_the_job_with_its_traceback(tmp_path):
    """An error inside rank 0's reports task (a defect of ours: it once took a list for a rank) ended that task
    alone, unsaid: the job ran on with no reports and no hang watch, and a hang in it was never named (2026-12-02).
    It ends the job instead, with the error's traceback, naming telemetry."""
    env = {"MPISCALE_TELEMETRY": "1", "MPISCALE_JOB_ID": "t16", "MPISCALE_TELEMETRY_INTERVAL_S": "0.2"}
    done = finish(start_mpi("telemetry_fault.py", 2, "3000", env=env, cwd=tmp_path), "a defective hang watch", 120)
    assert done.returncode == 1 and "user job done" not in done.stdout, done.output[-4000:]
    assert (
        "mpiscale: job failed on rank 0 of 2" in done.stderr and "telemetry (its reports and hang watch)" in done.stderr
    )
    assert "RuntimeError: a defect planted in the hang watch" in done.stderr, done.stderr[-4000:]


def test_the_heartbeat_goes_on_while_rank_0s_loop_is_held(tmp_path):
    """Rank 0 holds its event loop for 5 s (as Numba compiling does on a first run): its heartbeats go on from a
    thread, so a watcher of the file sees a live job, and the job finishes."""
    env = {"MPISCALE_TELEMETRY": "1", "MPISCALE_JOB_ID": "t12", "MPISCALE_TELEMETRY_INTERVAL_S": "0.5"}
    done = finish(start_mpi("user_job.py", 2, "60", "0", "20", "busy:5", env=env, cwd=tmp_path), "a busy rank 0", 120)
    assert_ok(done)
    assert "rank 0 holds its loop for 5 s at step 20" in done.stdout
    records = read_records(tmp_path / "user_job.telemetry.jsonl")
    beats = [p["time"] for p in records if p["kind"] == "heartbeat"]
    progress = [p["time"] for p in records if p["kind"] == "progress"]
    longest = max(np.diff(progress))  # the held loop: no progress for about 5 s ...
    assert longest >= 4.0, np.diff(progress)
    assert max(np.diff(beats)) < 2.0, np.diff(beats)  # ... but a heartbeat every interval or so
    shown = subprocess.run([*MPISCALE, "watch", "--file", str(tmp_path / "user_job.telemetry.jsonl"), "--no-follow"],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert shown.returncode == 0 and "NO HEARTBEAT" not in shown.stdout, shown.stdout + shown.stderr


@pytest.mark.parametrize("ranks, how", [(3, "block"), (2, "await")])
def test_a_hang_in_a_users_own_job_is_named_and_ends_it(tmp_path, ranks, how):
    """Rank 1 of a user's job blocks at its step 200 or later (after 2 s and a few reports) while the others wait
    in the allreduce: MPISCALE_HANG_* work for ``mpiscale.run`` jobs as for the project's own
    (its records under the script's name). Blocked in a native call its reports stop; stuck in an ``await`` they
    go on, and it is named all the same (its node leader, whose reports it shares, waits in the collective), the
    waiting rank's collective_wait_s growing all the while."""
    env = {"MPISCALE_TELEMETRY": "1", "MPISCALE_JOB_ID": f"t11{how}", "MPISCALE_HANG_AFTER_S": "2",
           "MPISCALE_HANG_ACTION": "abort", "MPISCALE_TELEMETRY_INTERVAL_S": "0.5"}  # fmt: skip
    job = start_mpi("user_job.py", ranks, "100000", "1", "200", *(["await"] if how == "await" else []), env=env,
                    cwd=tmp_path)  # fmt: skip
    done = finish(job, f"a user's job with a hang ({how})", 120)
    assert done.returncode == 1 and done.elapsed < 60, done.output[-4000:]
    named = re.search(r"mpiscale: telemetry: hang: rank 1 \(host [^)]*\) has not advanced for \d+ s \(step (\d+), ",
                      done.stderr)  # fmt: skip
    blocked = re.search(r"rank 1 blocks at step (\d+)", done.stdout)
    assert named and blocked and 0 < int(named[1]) < int(blocked[1]), done.output[-4000:]  # its last report before
    records = read_records(tmp_path / "user_job.telemetry.jsonl")
    hangs = [p for p in records if p["kind"] == "event" and p["event"] == "hang"]
    assert [p["rank"] for p in hangs] == [1] and "wait in collectives" in hangs[0]["detail"]
    assert records[-1] == {**records[-1], "kind": "status", "state": "failed", "command": "user_job"}
    waited = [p["values"]["collective_wait_s"] for p in records if p["kind"] == "metrics"]
    assert waited[-1]["max"] >= 1.0, waited[-3:]  # rank 0's wait, counted while it goes on


@pytest.mark.parametrize("ranks", [2, 3])
def test_an_error_raised_on_another_rank_is_one_failure_event_in_rank_0s_telemetry(tmp_path, ranks):
    """Rank 1 of a user's job raises: it prints the job's one report and aborts, and tells the ranks of its host
    first. Rank 0, told, gives its telemetry one failure event naming rank 1 and no second line on stderr (it had
    returned at once, and the job's records ended without the failure)."""
    # no straggler report in the 2 s this runs: a rank starved of its core for 1 s on a busy machine was one, a line
    # of its own on stderr, and this test counts the job's lines (stragglers: test_a_straggler_is_reported_...)
    env = {"MPISCALE_TELEMETRY": "1", "MPISCALE_JOB_ID": "t13", "MPISCALE_TELEMETRY_INTERVAL_S": "0.2",
           "MPISCALE_STRAGGLER_INTERVALS": "1000", **MPIRUN_GRACE}  # fmt: skip
    job = start_mpi("user_job.py", ranks, "100000", "1", "100", "raise", env=env, cwd=tmp_path)
    done = finish(job, "a user's job whose rank 1 raises", 120)
    assert done.returncode == 1, done.output[-4000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("mpiscale")]
    assert len(said) == 2 and said[0].startswith(f"mpiscale: job failed on rank 1 of {ranks} "), done.stderr[-4000:]
    assert said[1] == f"mpiscale: aborting all {ranks} ranks", done.stderr[-4000:]  # the report's last line
    assert "RuntimeError: the user's step" in done.stderr and "killed by a signal" not in done.stderr, done.stderr
    records = read_records(tmp_path / "user_job.telemetry.jsonl")
    failures = [p for p in records if p["kind"] == "event" and p["event"] == "failure"]
    assert [p["rank"] for p in failures] == [1], failures
    assert failures[0]["detail"] == "rank 1 failed and reported it; the job cannot go on", failures
    assert records[-1] == {**records[-1], "kind": "status", "state": "failed", "command": "user_job"}


def test_a_straggler_is_reported_and_the_job_goes_on(tmp_path):
    env = {"MPISCALE_JOB_ID": "t7", "MPISCALE_STRAGGLER_INTERVALS": "3",
           "MPISCALE_REHEARSE_FAILURE": "rank=2,iteration=10,slow=0.2"}  # fmt: skip
    done = finish(memstore(3, tmp_path / "m.h5", "--iterations", 40, env=env), "memstore with a straggler", 180)
    assert_ok(done)
    records = [json.loads(line) for line in (tmp_path / "m.h5.telemetry.jsonl").read_text().splitlines()]
    stragglers = [p for p in records if p["kind"] == "event" and p["event"] == "straggler"]
    assert [p["rank"] for p in stragglers] == [2], stragglers
    assert "the others wait for it" in stragglers[0]["detail"]


def test_watch_redraws_in_place_in_a_real_terminal(broker, tmp_path):
    """`mpiscale watch` in tmux: one view, redrawn in place as the job advances, that ends with the job."""
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (launch/setup.sh installs it)")
    server = ["tmux", "-L", f"mpiscale-test-{os.getpid()}"]
    watch = f"{sys.executable} -m mpiscale.cli watch t9 --broker {broker.address} --timeout 120; echo WATCH-EXIT $?"
    subprocess.run([*server, "new-session", "-d", "-x", "120", "-y", "40", f"{watch}; sleep 120"], check=True)
    try:
        job = memstore(2, tmp_path / "m.h5", "--iterations", 4000, env={"MPISCALE_BROKER": broker.address,
                                                                         "MPISCALE_JOB_ID": "t9"})  # fmt: skip
        screens, deadline = [""], time.monotonic() + 180
        while "WATCH-EXIT" not in screens[-1] and time.monotonic() < deadline:
            time.sleep(0.1)
            shown = subprocess.run([*server, "capture-pane", "-p"], capture_output=True, text=True, timeout=10)
            screens.append(shown.stdout)
        assert_ok(finish(job, "memstore watched in tmux", 60))
    finally:
        subprocess.run([*server, "kill-server"], capture_output=True, timeout=10)
    assert all(screen.count("job t9: memstore on 2 ranks") <= 1 for screen in screens)  # in place, never appended
    steps = [int(found) for screen in screens for found in re.findall(r"\] (\d+)/4000", screen)]
    assert len(set(steps)) >= 3 and steps == sorted(steps) and steps[-1] == 4000, steps
    assert "finished" in screens[-1] and "WATCH-EXIT 0" in screens[-1], screens[-1]


def test_rank_0_serves_prometheus_metrics_while_the_job_runs(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    port = free_port()
    env = {"MPISCALE_JOB_ID": "t10", "MPISCALE_PROMETHEUS_PORT": str(port), "MPISCALE_PROMETHEUS_ADDR": "127.0.0.1",
           "MPISCALE_TELEMETRY_INTERVAL_S": "0.25"}  # fmt: skip
    job = memstore(2, tmp_path / "m.h5", "--iterations", 6000, env=env)
    scraped, deadline = {}, time.monotonic() + 120
    while job.poll() is None and time.monotonic() < deadline:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        except OSError:
            time.sleep(0.1)
            continue
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for family in text_string_to_metric_families(text) for s in family.samples}  # fmt: skip
        # rank 0 publishes at each interval the reports it holds: the other rank's first may come one interval later
        reporting = samples.get(("mpiscale_ranks_reporting", (("job_id", "t10"),)), 0)
        if samples.get(("mpiscale_step", (("job_id", "t10"),)), 0) > 0 and reporting == 2:
            scraped = samples
            break
        time.sleep(0.1)
    done = finish(job, "memstore with a Prometheus endpoint", 120)
    assert_ok(done)
    assert f"Prometheus metrics at http://127.0.0.1:{port}/metrics" in done.stdout
    assert scraped, "no scrape showed progress reported by both ranks"
    assert scraped[("mpiscale_total", (("job_id", "t10"),))] == 6000
    assert scraped[("mpiscale_ranks_reporting", (("job_id", "t10"),))] == 2
    spread = {labels: value for (name, labels), value in scraped.items() if name == "mpiscale_rank_metric"}
    rss = dict(spread)[(("job_id", "t10"), ("name", "rss_mib"), ("stat", "max"))]
    assert 50 < rss < 24 * 1024
    with pytest.raises(OSError):  # the endpoint ends with the job
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)


def test_the_prometheus_endpoint_on_an_ipv6_address_prints_a_url_that_serves_it(capfd):
    from mpiscale.telemetry.prometheus import open_endpoint

    try:
        free_port("::1")
    except OSError:
        pytest.skip("this machine has no IPv6 loopback")
    endpoint = open_endpoint("t11", 0, "::1")
    assert endpoint is not None
    try:
        url = re.search(r"Prometheus metrics at (\S+)", capfd.readouterr().out).group(1)
        assert url == f"http://[::1]:{endpoint.port}/metrics"  # was http://::1:PORT/metrics, which no client takes
        assert urllib.request.urlopen(url, timeout=5).status == 200
    finally:
        endpoint.close()


def test_a_stuck_pipeline_stage_is_named_by_the_hang_watch(tmp_path):
    """Stage 1 of 3 blocks in a forward pass: its neighbours wait for its messages (no collective), and that wait
    counts as waiting on others, so the watch names rank 1 and what stage 0 waits for from it. The threshold is
    above a loaded start-up's: with 2 s, in a loaded run of the suite, rank 2 built its stage (its loop busy, no
    report for 2 s) while rank 1 already waited for stage 0, and the watch rightly named rank 2 at step 0."""
    env = {"MPISCALE_TELEMETRY": "1", "MPISCALE_JOB_ID": "t25", "MPISCALE_HANG_AFTER_S": "8",
           "MPISCALE_HANG_ACTION": "abort", "MPISCALE_TELEMETRY_INTERVAL_S": "0.5"}  # fmt: skip
    options = ["--stages", "3", "--micro-batches", "4", "--epochs", "5", "--out", str(tmp_path / "m.h5")]
    started = time.time()
    job = start_mpi("pipeline_train_fault.py", 3, "hang", "1", "60", *options, env=env, cwd=tmp_path)
    done = finish(job, "a pipeline with a stuck stage", 120)
    assert done.returncode == 1, done.output[-4000:]
    assert ended_after(done, started, r"rank 1 blocks at step 60 at ([\d.]+)") < 30, done.output[-4000:]
    records = read_records(tmp_path / "m.h5.telemetry.jsonl")
    hangs = [p for p in records if p["kind"] == "event" and p["event"] == "hang"]
    assert [p["rank"] for p in hangs] == [1], hangs
    assert re.search(r"rank 0: pipeline stage 0 for the gradient of micro-batch \d \(step 60\) from stage 1, ",
                     hangs[0]["detail"]), hangs[0]["detail"]  # fmt: skip
