"""A durable memory store under real mpirun: a rank killed mid-iteration, its node's disk gone, the job restarted.

Every recovered run is compared bit for bit with an uninterrupted one: the
final records and every iteration's aggregates and top-k. Nothing lost, nothing
applied twice.
"""

import re
import shutil
import signal
import sys
import time

import pytest
from helpers import PROGRAMS, assert_ok, finish, launch, run_cli
from memstore_files import assert_same as assert_equal_runs
from memstore_files import results

MPISCALE = [sys.executable, "-m", "mpiscale.cli"]
WORKLOAD = ["--records", "60000", "--iterations", "50", "--top", "20", "--checkpoint-every", "10"]


def memstore(ranks: int, *args, env=None, options=(), timeout: float = 240):
    return run_cli(ranks, "memstore", *WORKLOAD, *args, env=env, options=options, timeout=timeout)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: the same workload on one rank, not durable, never interrupted."""
    out = tmp_path_factory.mktemp("reference") / "reference.h5"
    assert_ok(memstore(1, "--out", out))
    return results(out)


def assert_same(run, reference) -> None:
    assert_equal_runs(run, reference, records=60000, iterations=50)


def test_rank_killed_with_its_node_disk_gone_is_restarted_and_loses_nothing(tmp_path, uninterrupted):
    """4 ranks on 2 simulated nodes; rank 2 dies in iteration 25 and node 1's local directory goes with it."""
    out = tmp_path / "store.h5"
    job = memstore(
        4, "--out", out, "--checkpoint-dir", tmp_path / "checkpoints", "--local-dir", tmp_path / "local",
        env={"MPISCALE_REHEARSE_FAILURE": "rank=2,iteration=25,lose-local"},
        options=("--ranks-per-node", "2", "--restarts", "1"),
    )  # fmt: skip
    assert_ok(job)
    killed = re.search(r"rank 2 is killed in iteration 25 at ([\d.]+)", job.stderr)
    assert killed and "restart 1 of 1" in job.stderr, job.output[-4000:]
    run = results(out)
    report = run[2]
    assert report["restart"] == 1 and report["iterations_done"] == 25
    # commit 1 is the load, commit t + 2 iteration t: the newest whole checkpoint from node 0's own shards and its
    # partner copies of node 1's, then every commit after it up to iteration 24's (commit 26: iteration 25 died with
    # rank 2 before any rank could commit it). Checkpoints are written in the background: the one after iteration 19
    # (commit 21) is whole by then on a quiet host; on a loaded one it may not be, and the one after iteration 9
    # (commit 11, whose logs are kept until the next checkpoint is whole) is the start
    source = re.fullmatch(r"the checkpoint of commit (\d+) \(local\+partner\); (\d+) commits from 4 logs "
                          r"\(2 of them partner copies\)", report["source"])  # fmt: skip
    assert source and int(source[1]) in (11, 21) and int(source[1]) + int(source[2]) == 26, report
    assert_same(run, uninterrupted)
    print(f"failure to first new iteration: {report['resumed_at'] - float(killed.group(1)):.2f} s; store recovery "
          f"{report['seconds']['total']:.2f} s")  # fmt: skip


def test_sigterm_stops_the_store_after_an_iteration_and_a_rerun_on_fewer_ranks_goes_on(tmp_path, uninterrupted):
    """SIGTERM (scancel, preemption) to the launcher in an iteration that takes longer than the second mpirun
    gives its ranks after its own SIGTERM: every rank stops after the same iteration with a checkpoint; the rerun
    on 3 ranks instead of 4 recovers it and ends as the uninterrupted run."""
    out, checkpoints = tmp_path / "store.h5", tmp_path / "checkpoints"
    slowed = {"MPISCALE_REHEARSE_FAILURE": "rank=0,iteration=0,slow=1.5", "MPISCALE_TELEMETRY_INTERVAL_S": "0.2"}
    command = [*MPISCALE, "memstore", *WORKLOAD, "--out", str(out), "--checkpoint-dir", str(checkpoints)]
    job = launch(4, command, env=slowed)
    telemetry, deadline = tmp_path / "store.h5.telemetry.jsonl", time.monotonic() + 120
    while job.poll() is None and time.monotonic() < deadline and '"step": 2,' not in _text(telemetry):
        time.sleep(0.05)
    time.sleep(0.5)  # inside an iteration of 1.5 s
    job.send_signal(signal.SIGTERM)
    stopped = finish(job, "mpiscale memstore after SIGTERM", 60)
    assert stopped.returncode != 0 and "stopping after the current step with a checkpoint" in stopped.stderr
    where = re.search(r"stopped on request \(a stop command or SIGTERM\) after iteration (\d+)", stopped.stdout)
    assert where is not None and 2 <= int(where[1]) < 50, stopped.output[-3000:]
    rerun = memstore(3, "--out", out, "--checkpoint-dir", checkpoints)
    assert_ok(rerun)
    assert f"recovered 60,000 records after iteration {where[1]} from the checkpoint" in rerun.stdout
    assert_same(results(out), uninterrupted)


@pytest.mark.parametrize("telemetry", ["0", "1"], ids=["telemetry-off", "telemetry-on"])
def test_a_sigterm_after_steps_turned_slow_still_stops_with_a_checkpoint(tmp_path, uninterrupted, telemetry):
    """The stop is agreed by the runtime's steering, with telemetry off or on; iterations of under a millisecond
    turn 1,000 times slower (a straggler) before the SIGTERM: every rank still stops after the same iteration within
    the 3 s grace, with a checkpoint, and the rerun on 3 ranks ends as the uninterrupted run."""
    out, checkpoints, log = tmp_path / "store.h5", tmp_path / "checkpoints", tmp_path / "stdout.txt"
    env = {
        "MPISCALE_TELEMETRY": telemetry,
        "MPISCALE_STOP_GRACE_S": "3",
        "MPISCALE_REHEARSE_FAILURE": "rank=1,iteration=20,slow=0.5",
    }
    command = [*MPISCALE, "memstore", *WORKLOAD, "--out", str(out), "--checkpoint-dir", str(checkpoints),
               "--progress-every", "0.01"]  # fmt: skip
    with log.open("w") as stdout:
        job = launch(2, command, env=env, stdout=stdout)
        deadline = time.monotonic() + 120
        while job.poll() is None and time.monotonic() < deadline and max(_iterations(log), default=0) < 21:
            time.sleep(0.05)
        time.sleep(0.2)  # inside a slow iteration
        seen, signalled = max(_iterations(log)), time.monotonic()
        job.send_signal(signal.SIGTERM)
        stopped = finish(job, "mpiscale memstore after SIGTERM, telemetry off", 60)
    took, output = time.monotonic() - signalled, _text(log) + stopped.stderr
    assert (out.parent / "store.h5.telemetry.jsonl").exists() == (telemetry == "1")
    assert stopped.returncode != 0 and "did not stop within" not in output, output[-3000:]
    where = re.search(r"stopped on request \(a stop command or SIGTERM\) after iteration (\d+)", output)
    # the iteration in flight when the signal came (seen + 1 at most), and the next: the round posted at the end of
    # the one is read at the end of the other
    assert where is not None and seen < int(where[1]) <= seen + 3 and took < 10, (seen, took, output[-3000:])
    rerun = memstore(3, "--out", out, "--checkpoint-dir", checkpoints)
    assert_ok(rerun)
    assert f"recovered 60,000 records after iteration {where[1]} from the checkpoint" in rerun.stdout
    assert_same(results(out), uninterrupted)


def _text(path) -> str:
    return path.read_text() if path.exists() else ""


def _iterations(log) -> list[int]:
    """The iterations the progress lines in ``log`` have shown so far."""
    return [int(number) for number in re.findall(r"^iteration (\d+)/", _text(log), re.MULTILINE)]


def test_recovery_on_fewer_ranks_with_a_torn_log_tail(tmp_path, uninterrupted):
    """Killed on 4 ranks (2 nodes); rerun on 3 ranks on one node, from node 0's files only, one log torn."""
    out, checkpoints, local = tmp_path / "store.h5", tmp_path / "checkpoints", tmp_path / "local"
    durable = ("--out", out, "--checkpoint-dir", checkpoints, "--local-dir", local)
    job = memstore(
        4, *durable, env={"MPISCALE_REHEARSE_FAILURE": "rank=1,iteration=33"}, options=("--ranks-per-node", "2")
    )
    assert job.returncode == 137, job.output[-4000:]
    newest = max((local / "node-0" / "wal").glob("*.rank-00000-*"), key=lambda path: path.name)
    tear(newest, 34)
    shutil.rmtree(local / "node-1")  # node 1's disk is gone with it (recovery reads every node-K folder it finds)
    job = memstore(3, *durable)
    assert_ok(job)
    run = results(out)
    # every log held iterations 30-32 (commits 32-34); rank 0's now ends at commit 33, so the recovery stops there
    # for every rank, and iteration 32 is redone. It starts from the checkpoint of commit 31, or, where that one was
    # still being written in the background when rank 1 died two iterations later (a loaded machine), from commit
    # 21's with ten more commits from the logs
    assert run[2]["iterations_done"] == 32, run[2]
    source = re.fullmatch(
        r"the checkpoint of commit (\d+) \(local\+partner\); (\d+) commits from 4 logs \(2 of them partner copies\)",
        run[2]["source"],
    )
    assert source and source[1] in ("21", "31") and int(source[1]) + int(source[2]) == 33, run[2]
    assert_same(run, uninterrupted)


def tear(path, commit: int) -> None:
    """Cut a log inside the record of ``commit``, as a write cut short would (what followed it goes too)."""
    data = path.read_bytes()
    offset = 8  # the magic; then records of (length u32, crc u32, body starting with the commit's u64)
    while offset < len(data):
        length, number = (
            int.from_bytes(data[offset : offset + 4], "little"),
            int.from_bytes(data[offset + 8 : offset + 16], "little"),
        )
        if number == commit:
            path.write_bytes(data[: offset + 8 + length // 2])
            return
        offset += 8 + length
    raise AssertionError(f"{path} holds no commit {commit}")


def test_damaged_log_and_another_jobs_store_are_refused(tmp_path):
    out, checkpoints = tmp_path / "store.h5", tmp_path / "checkpoints"
    job = memstore(2, "--out", out, "--checkpoint-dir", checkpoints, "--iterations", 14)
    assert_ok(job)
    refused = memstore(2, "--out", out, "--checkpoint-dir", checkpoints, "--seed", 5)
    assert refused.returncode == 2 and "belongs to another job (seed: logged 0, now 5)" in refused.stderr, (
        refused.stderr
    )
    log = max((checkpoints / "wal").glob("*.rank-00001-*"), key=lambda path: path.name)
    data = bytearray(log.read_bytes())
    data[20] ^= 0xFF  # inside the first record, with others after it: damage, not a torn tail
    log.write_bytes(bytes(data))
    refused = memstore(2, "--out", out, "--checkpoint-dir", checkpoints)
    assert refused.returncode == 2 and str(log) in refused.stderr and "damaged" in refused.stderr, refused.stderr


@pytest.mark.parametrize(
    ("first", "then"), [((4, 2), (3, 0)), ((2, 0), (4, 2))], ids=["4ranks-2nodes-to-3ranks", "2ranks-to-4ranks-2nodes"]
)
def test_python_api_recovers_upserts_deletes_and_reinforcements_on_another_world_size(tmp_path, first, then):
    """The store's own API: upserts (new and overwritten), a delete and reinforcements replayed from the logs
    after a rank is killed, on another number of ranks and nodes; checked bit for bit against a numpy model."""

    def run(ranks: int, per_node: int, *args):
        options = ("--ranks-per-node", str(per_node)) if per_node else ()
        command = [sys.executable, str(PROGRAMS / "memstore_invariance.py"), "4000", "14", str(tmp_path), *args]
        process = launch(ranks, command, options=options, cwd=tmp_path)
        return finish(process, f"memstore_invariance on {ranks} ranks", 180)

    killed = run(*first, "16")  # steps 13-15 (a reinforcement, an upsert, the delete) follow the checkpoint of 12
    assert killed.returncode == 137, killed.output[-4000:]
    job = run(*then)
    assert_ok(job)
    # from the checkpoint of commit 12 and commits 13-15 from the logs, or, where that checkpoint was still being
    # written in the background when the kill came four commits later (a loaded machine), from commit 6's with nine
    source = re.search(r"recovered 15 commits from the checkpoint of commit (\d+) \([^)]*\); (\d+) commits from",
                       job.stdout)  # fmt: skip
    assert source and source[1] in ("6", "12") and int(source[1]) + int(source[2]) == 15, job.output[-4000:]
    assert f"memstore ok: {then[0]} ranks, 4040 records" in job.stdout


def test_lost_logs_are_refused_until_the_rollback_is_accepted(tmp_path, uninterrupted):
    """Both simulated nodes' local directories gone after 14 iterations (checkpoint of iteration 10, commit 11, the
    load being commit 1): the rerun is
    refused, naming the lost logs and the commits after the checkpoint; accepted, it redoes them and ends as the
    uninterrupted run. A rerun with another --local-dir is the same case."""
    out, checkpoints, local = tmp_path / "store.h5", tmp_path / "checkpoints", tmp_path / "local"
    durable = ("--out", out, "--checkpoint-dir", checkpoints, "--local-dir", local)
    nodes = ("--ranks-per-node", "1")
    assert_ok(memstore(2, *durable, "--iterations", 14, options=nodes))
    elsewhere = memstore(2, "--out", out, "--checkpoint-dir", checkpoints, "--local-dir", tmp_path / "other",
                         options=nodes)  # fmt: skip
    shutil.rmtree(local)
    refused = memstore(2, *durable, options=nodes)
    for job in (elsewhere, refused):
        assert job.returncode == 2, job.output[-3000:]
        assert "of ranks [0, 1] are gone from" in job.stderr and "node-*" in job.stderr, job.stderr
        assert "every commit after the checkpoint of commit 11 would be lost" in job.stderr
        assert "--accept-rollback" in job.stderr and "Traceback" not in job.stderr
    accepted = memstore(2, *durable, "--accept-rollback", options=nodes)
    assert_ok(accepted)
    assert "the rollback is accepted" in accepted.stderr
    assert "recovered 60,000 records after iteration 10 from the checkpoint" in accepted.stdout, accepted.stdout
    assert_same(results(out), uninterrupted)


def test_a_deleted_journal_record_is_refused_and_keeps_the_logs(tmp_path, uninterrupted):
    out, checkpoints = tmp_path / "store.h5", tmp_path / "checkpoints"
    assert_ok(memstore(2, "--out", out, "--checkpoint-dir", checkpoints, "--iterations", 14))
    logs = sorted(path.name for path in (checkpoints / "wal").glob("*.wal"))
    (checkpoints / "journal.json").unlink()
    refused = memstore(2, "--out", out, "--checkpoint-dir", checkpoints)
    assert refused.returncode == 2, refused.output[-3000:]
    assert f"{checkpoints / 'journal.json'} is missing, but 4 log files, checkpoints [11] of an earlier run" in (
        refused.stderr
    ), refused.stderr
    assert sorted(path.name for path in (checkpoints / "wal").glob("*.wal")) == logs  # nothing deleted
    assert_ok(memstore(2, "--out", out, "--checkpoint-dir", checkpoints, "--accept-rollback"))
    assert_same(results(out), uninterrupted)


def test_a_damaged_length_field_is_not_taken_for_a_torn_tail(tmp_path):
    """The first record of a log after the checkpoint claims 4 GB: the later intact commits of that log must not be
    dropped as if a crash had torn it."""
    out, checkpoints = tmp_path / "store.h5", tmp_path / "checkpoints"
    assert_ok(memstore(2, "--out", out, "--checkpoint-dir", checkpoints, "--iterations", 14))
    log = max((checkpoints / "wal").glob("*.rank-00001-*"), key=lambda path: path.name)
    data = bytearray(log.read_bytes())
    data[8:12] = (0xFFFFFF00).to_bytes(4, "little")  # the first record's length (after the 8-byte magic)
    log.write_bytes(bytes(data))
    refused = memstore(2, "--out", out, "--checkpoint-dir", checkpoints)
    assert refused.returncode == 2, refused.output[-3000:]
    assert f"the log {log} is damaged after commit 11" in refused.stderr, refused.stderr
    assert "other logs hold commits up to 15" in refused.stderr and "commits after 11 would be lost" in refused.stderr


def test_two_jobs_on_one_node_local_directory(tmp_path):
    """A second job on the first one's node-local directory is refused before it touches the first one's logs."""
    local = tmp_path / "local"
    first = [*MPISCALE, "memstore", *WORKLOAD, "--iterations", "1000000", "--out", str(tmp_path / "a.h5"),
             "--checkpoint-dir", str(tmp_path / "a"), "--local-dir", str(local)]  # fmt: skip
    job = launch(2, first)
    deadline = time.monotonic() + 120
    while job.poll() is None and time.monotonic() < deadline and not list(local.glob("node-0/wal/*.wal")):
        time.sleep(0.05)
    logs = sorted(local.glob("node-0/wal/*.wal"))
    assert logs, "the first job never started its logs"
    run = logs[0].name.split(".")[0]  # its checkpoints rotate its segments; the run's own stay
    second = memstore(2, "--out", tmp_path / "b.h5", "--checkpoint-dir", tmp_path / "b", "--local-dir", local)
    assert second.returncode == 2, second.output[-3000:]
    assert f"node-local directory {local / 'node-0'} is in use by another job" in second.stderr, second.stderr
    assert list(local.glob(f"node-0/wal/{run}.*.wal")) and job.poll() is None
    job.send_signal(signal.SIGTERM)
    stopped = finish(job, "the first memstore after SIGTERM", 60)
    assert "stopped on request" in stopped.stdout, stopped.output[-3000:]
