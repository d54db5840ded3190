"""The local multi-node cluster (``hpc/cluster/``): separate hosts, networks and node-local disks on one machine.

Each node is a network, UTS and mount namespace with its own hostname, an address on a private bridge and a private
tmpfs; Open MPI starts its daemons there through ``hpc/cluster/enter`` and talks TCP between the nodes. The module
brings up 3 nodes once and tears them down at its end (its last test checks that nothing is left). Where namespaces
cannot be made (not root, a container that refuses them) the module is skipped, saying why; under
``MPISCALE_REQUIRE_CLUSTER=1`` it fails instead.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers import MPIRUN_GRACE, PROGRAMS, REPO, SESSION_ENVIRONMENT, Job, Preloaded, assert_ok, finish
from memstore_files import assert_same, results
from slurm_cluster import Controller

from mpiscale.runtime.death_watch import alive

CLUSTER = REPO / "hpc" / "cluster"
NODES = 3
LOCAL = "/mnt/mpiscale-local"


def cluster(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([str(CLUSTER / "cluster.sh"), *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def nodes():
    """The cluster of ``NODES`` nodes, up for the module (started afresh, however an earlier run left it)."""
    cluster("down")
    began = time.monotonic()
    made = cluster("up", str(NODES))
    started = time.monotonic() - began
    if made.returncode != 0:
        if os.environ.get("MPISCALE_REQUIRE_CLUSTER") == "1":
            pytest.fail(f"MPISCALE_REQUIRE_CLUSTER=1 but the cluster did not start: {made.stderr}")
        pytest.skip(f"no local cluster here: {made.stderr.strip()}")
    yield started
    cluster("down")


def mpirun(ranks: int, command: list[str]) -> list[str]:
    """The launch line of ``command`` on ``ranks`` ranks over the cluster's nodes, 2 per node; a ``python`` command
    starts warm, each rank inside its node's namespaces (``tests/warm_start.py``)."""
    return [str(CLUSTER / "mpirun"), "-n", str(ranks), "--", *Preloaded.command(command)]


def across(ranks: int, command: list[str], what: str, timeout: float = 120, env: dict | None = None) -> Job:
    """``command`` on ``ranks`` ranks over the cluster's nodes, with a hard timeout."""
    environment = SESSION_ENVIRONMENT | {"PYTHONUNBUFFERED": "1", "MPISCALE_TELEMETRY": "0"} | (env or {})
    process = subprocess.Popen(mpirun(ranks, command), env=environment, cwd=REPO, text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
    return finish(process, what, timeout)


def on_node(node: str, command: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(CLUSTER / "enter"), node, command], capture_output=True, text=True, timeout=30)


PLACEMENT = """
import os
import socket
import mpiscale

async def main(system):
    h = system.hierarchy
    spaces = tuple(os.readlink(f"/proc/self/ns/{kind}") for kind in ("net", "uts", "mnt"))
    rows = system.world.comm.allgather((system.rank, socket.gethostname(), h.node_index, h.node_count, h.node.rank,
                                        h.leaders is not None, *spaces))
    if system.rank == 0:
        for row in rows:
            print("placed", *row)

mpiscale.run(main)
"""


def test_the_cluster_starts_within_its_goal_and_every_node_is_its_own_host(nodes):
    assert nodes < 20, f"the cluster took {nodes:.1f} s to start"
    shown = cluster("status")
    assert shown.returncode == 0 and shown.stdout.split("\n")[:NODES] == [
        f"node{k} 10.77.0.{10 + k} up" for k in range(1, NODES + 1)
    ], shown.stdout
    names = [on_node(f"node{k}", "hostname").stdout.strip() for k in range(1, NODES + 1)]
    assert names == [f"node{k}" for k in range(1, NODES + 1)]
    holders = [int(Path(f"/run/mpiscale-cluster/node{k}.pid").read_text()) for k in range(1, NODES + 1)]
    assert [os.getsid(pid) for pid in holders] == holders  # sessions of their own: the caller's signals miss them
    again = cluster("up", str(NODES))  # idempotent
    assert again.returncode == 0 and "already up" in again.stdout


@pytest.mark.parametrize("start", ["warm", "cold"])
def test_ranks_run_on_separate_hosts_and_the_node_communicators_follow_them(nodes, tmp_path, start):
    """6 ranks, 2 per node: each node's ranks see their own hostname; the runtime finds 3 nodes of 2 from the
    hosts themselves (no MPISCALE_RANKS_PER_NODE), with the first rank of each leading it. Each rank is in its
    node's network, UTS and mount namespaces, started cold or warm (forked on the machine, then joining them)."""
    if start == "warm":  # a program file starts warm (helpers.Preloaded), ``-c`` cold
        program = tmp_path / "placement.py"
        program.write_text(PLACEMENT)
        command = [sys.executable, str(program)]
    else:
        command = [sys.executable, "-c", PLACEMENT]
    job = across(6, command, f"placement on 3 nodes, {start}")
    assert_ok(job)
    rows = [line.split()[1:] for line in job.stdout.splitlines() if line.startswith("placed")]
    assert [tuple(r[1:6]) for r in rows] == [
        (f"node{k // 2 + 1}", str(k // 2), "3", str(k % 2), str(k % 2 == 0)) for k in range(6)
    ], job.stdout
    for row in rows:
        holder = Path(f"/run/mpiscale-cluster/{row[1]}.pid").read_text().strip()
        assert row[6:] == [os.readlink(f"/proc/{holder}/ns/{kind}") for kind in ("net", "uts", "mnt")], row


@pytest.mark.parametrize("ranks", [4, 6])
def test_the_hierarchical_allreduce_across_hosts_matches_numpy(nodes, ranks):
    """programs/hierarchical.py over TCP between 2 and 3 hosts: sums, every dtype and op it checks, the same bits
    on every rank."""
    job = across(ranks, [sys.executable, str(PROGRAMS / "hierarchical.py")], f"hierarchical on {ranks} ranks",
                 env={"MPISCALE_HIERARCHICAL_MIN_BYTES": "4096"})  # fmt: skip
    assert_ok(job)
    assert f"hierarchical allreduce ok: {ranks} ranks, {ranks // 2} nodes" in job.stdout, job.stdout


@pytest.mark.parametrize("mode", ["plain-first-half", "plain-first-half-dup-again"])
def test_ranks_waiting_in_a_call_that_another_hosts_ranks_never_make_end_at_once_naming_both(nodes, tmp_path, mode):
    """A plain mpi4py program (no runtime) whose ranks on the first host call ``ranks.agree`` on the world's
    communicator, or a second time on a copy of it, while the second host's ranks' programs end: the first host's
    waited for ever (the ends' markers are only seen on their own host). The ends' checked exchange, on the world
    and on each communicator a rank used, meets the call's: the job ends at once, with one report naming each
    rank's call."""
    program = [sys.executable, str(PROGRAMS / "only_rank_0.py"), str(tmp_path), "agree", mode]
    job = across(4, program, "agree on the first host's ranks alone", timeout=60)
    assert job.returncode != 0 and job.elapsed < 30, job.output[-3000:]
    assert re.search(r"CollectiveMismatch: agree\(checking the inputs\): the ranks of its communicator came to "
                     r"different collective calls: ranks 0-1: agree\(checking the inputs\), at only_rank_0.py:\d+; "
                     r"ranks 2-3: the end of its program ", job.stderr), job.stderr[-3000:]  # fmt: skip
    assert job.stderr.count("Traceback") == 1, job.stderr[-3000:]


def test_training_across_hosts_follows_one_process(nodes, tmp_path):
    """mpiscale train on 4 ranks over 2 hosts (parallel HDF5 on the shared file system, gradients over TCP), and a
    pipeline of 2 stages with one stage per host (activations and gradients over TCP), each against one rank: the
    same weights within rounding."""
    settings = ["train", "--epochs", "1", "--batch-size", "60", "--hidden", "32", "--progress-every", "0"]
    cli = [sys.executable, "-m", "mpiscale.cli", *settings]
    assert_ok(across(1, [*cli, "--out", str(tmp_path / "one.h5")], "train on 1 rank"))
    assert_ok(across(4, [*cli, "--out", str(tmp_path / "four.h5")], "train on 2 hosts"))
    pipeline = [*cli, "--stages", "2", "--micro-batches", "4", "--out", str(tmp_path / "stages.h5")]
    assert_ok(across(2, pipeline, "a stage on each of 2 hosts", env={"SLOTS": "1"}))
    one = _weights(tmp_path / "one.h5")
    for name in ("four", "stages"):
        with h5py.File(tmp_path / f"{name}.h5", "r") as run:
            assert run.attrs["hosts"] == '["node1", "node2"]', name
        got = _weights(tmp_path / f"{name}.h5")
        assert got.keys() == one.keys()
        for weight, values in one.items():
            np.testing.assert_allclose(got[weight], values, rtol=1e-4, atol=1e-5, err_msg=f"{name}: {weight}")


STORE = ["memstore", "--records", "60000", "--iterations", "200", "--top", "20", "--checkpoint-every", "10"]


def _killed_mid_run(
    ranks: int, command: list[str], environment: dict, log: Path, lost: str, stderr: int
) -> tuple[Job, float]:
    """``command`` on ``ranks`` ranks over the cluster (its output in ``log``; its stderr there too, or kept in the
    job), with node ``lost`` killed at its iteration 40: the job as it ended, and when the node was killed."""
    with open(log, "w") as output:
        job = subprocess.Popen(mpirun(ranks, command), env=environment, cwd=REPO, text=True, stdout=output,
                               stderr=stderr, start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and job.poll() is None and _iterations(log) < 40:
            time.sleep(0.05)
        assert job.poll() is None, log.read_text()[-4000:]
        killed = time.time()
        assert cluster("kill", lost).returncode == 0
        return finish(job, f"the job after {lost} was killed", 90), killed


@pytest.mark.parametrize(
    "ranks, lost, rerun, remain",
    [(4, "node2", 4, "node1 and node3"), (4, "node1", 4, "node2 and node3"), (6, "node2", 4, "node1 and node3")],
)
def test_a_memory_store_loses_nothing_when_a_whole_node_is_lost(nodes, tmp_path, ranks, lost, rerun, remain):
    """4 ranks on node1 and node2 (or 6 on all three), node-local logs and checkpoint shards on each node's own disk
    (partner copies on the next node); one node killed whole mid-run, its disk with it. The job ends; rerun on the
    nodes that remain (on 4 ranks) it recovers from the partner copies and ends with every record and every
    iteration's aggregates and top-k equal, bit for bit, to one uninterrupted rank. With node1 lost, node2 is the
    rerun's first node: its disk holds its logs under the number it had (node-1), which the rerun read only under
    its new one (node-0) and called every log lost."""
    cli = [sys.executable, "-m", "mpiscale.cli"]
    reference = tmp_path / "reference.h5"
    assert_ok(across(1, [*cli, *STORE, "--out", str(reference)], "the uninterrupted store"))
    durable = [*STORE, "--out", str(tmp_path / "store.h5"), "--checkpoint-dir", str(tmp_path / "checkpoints"),
               "--local-dir", LOCAL, "--progress-every", "0.1"]  # fmt: skip
    # rank 0 is 50 ms slower from iteration 30 on (the first run only): the 200 iterations take 1.2 s, and a test
    # process starved on a loaded machine saw iteration 40 only once the job had ended
    slowed = {"MPISCALE_REHEARSE_FAILURE": "rank=0,iteration=30,slow=0.05"}
    environment = SESSION_ENVIRONMENT | {"PYTHONUNBUFFERED": "1", "MPISCALE_TELEMETRY": "0"}
    log = tmp_path / "first.log"
    try:
        ended, killed = _killed_mid_run(ranks, [*cli, *durable], environment | slowed, log, lost, subprocess.STDOUT)
        ended_at = time.time()
        assert ended.returncode != 0, log.read_text()[-4000:]
        again = across(rerun, [*cli, *durable], f"the store rerun on {remain}", timeout=180)
        assert_ok(again)
        run = results(tmp_path / "store.h5")
        assert "(local+partner)" in run[2]["source"] and "partner copies" in run[2]["source"], run[2]
        assert_same(run, results(reference), records=60000, iterations=200)
        resumed, began, prepared = run[2]["resumed_at"], run[2]["process_started_at"], run[2]["prepared_at"]
        assert ended_at < began < prepared < resumed, run[2]
        print(f"{lost} killed to the rerun's first iteration: {resumed - killed:.1f} s (the job's end "
              f"{ended_at - killed:.1f} s, the relaunch to rank 0's process {began - ended_at:.1f} s, its imports and "
              f"MPI's start {prepared - began:.1f} s, then to the first iteration {resumed - prepared:.1f} s, of "
              f"which recovery {run[2]['seconds']['total']:.2f} s)")  # fmt: skip
    finally:
        cluster("up", str(NODES))  # the whole cluster again for the tests after this one (afresh: a node is gone)


@pytest.mark.parametrize("lost, reporter", [("node2", 0), ("node1", 2)])
def test_a_lost_node_is_one_line_and_one_failure_event_from_a_rank_that_remains(nodes, tmp_path, lost, reporter):
    """Before: 38-46 lines of Open MPI's banners (one blaming the daemons' start-up) before a line naming the node,
    and with node1 lost (rank 0's) no telemetry named it at all (issue 59, item 16)."""
    cli = [sys.executable, "-m", "mpiscale.cli"]
    out = tmp_path / "store.h5"
    command = [*cli, "memstore", "--records", "60000", "--iterations", "1000000", "--out", str(out), "--checkpoint-dir",
               str(tmp_path / "checkpoints"), "--local-dir", LOCAL, "--progress-every", "0.1"]  # fmt: skip
    # mpirun's own grace before it kills the ranks (the suite's is 0): the ranks that remain report in it
    environment = SESSION_ENVIRONMENT | MPIRUN_GRACE | {"PYTHONUNBUFFERED": "1", "MPISCALE_TELEMETRY": "1"}
    try:
        ended, _ = _killed_mid_run(4, command, environment, tmp_path / "out.log", lost, subprocess.PIPE)
    finally:
        cluster("up", str(NODES))
    assert ended.returncode != 0
    named = [line for line in ended.stderr.splitlines() if lost in line]
    assert len(named) == 1 and f"node {lost} (ranks " in named[0], ended.stderr
    assert f"mpiscale: rank {reporter}: node {lost}" in named[0], ended.stderr
    assert "ORTE" not in ended.stderr and "-----" not in ended.stderr, ended.stderr
    records = [json.loads(line) for line in Path(f"{out}.telemetry.jsonl").read_text().splitlines()]
    failures = [r for r in records if r["kind"] == "event" and r["event"] == "failure"]
    assert len(failures) == 1 and f"node {lost} (ranks " in failures[0]["detail"], failures
    assert records[-1]["kind"] == "status" and records[-1]["state"] == "failed", records[-1]


def test_a_node_lost_while_the_ranks_that_remain_are_held_in_hdf5_is_still_one_line_and_one_failure_event(
    nodes, tmp_path
):
    """node1's ranks wait in a parallel HDF5 open for node2's, which never come, and node2 is killed. h5py keeps the
    GIL there: no Python of theirs runs, the event loop's node watch included. Before, the job ended after
    mpirun's grace with no line of the ranks' and no telemetry event (1 run in 5 of the memory store above, killed
    during a background checkpoint's open); now rank 0's node sentry names node2 in its place, and its kill of the
    held rank is no death for node1's death watch to name."""
    program = [sys.executable, str(PROGRAMS / "held_in_hdf5.py"), str(tmp_path / "never.h5")]
    environment = SESSION_ENVIRONMENT | MPIRUN_GRACE | {"PYTHONUNBUFFERED": "1", "MPISCALE_TELEMETRY": "1"}
    log = tmp_path / "out.log"
    try:
        with open(log, "w") as output:
            job = subprocess.Popen(mpirun(4, program), env=environment, cwd=tmp_path, text=True, stdout=output,
                                   stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and job.poll() is None and log.read_text().count(" holds") < 2:
                time.sleep(0.05)
            assert log.read_text().count(" holds") == 2, log.read_text()
            time.sleep(0.5)  # both are in the open, its GIL held
            assert cluster("kill", "node2").returncode == 0
            ended = finish(job, "the held job after node2 was killed", 90)
    finally:
        cluster("up", str(NODES))
    assert ended.returncode != 0
    named = [line for line in ended.stderr.splitlines() if "node2" in line]
    assert len(named) == 1 and named[0].startswith("mpiscale: rank 0: node node2 (ranks 2, 3) was lost"), ended.stderr
    assert named[0].endswith("(said by its node watch: the rank was held)"), named
    assert "ended while the job ran" not in ended.stderr, ended.stderr  # the sentry's kill of rank 0 is no death
    records = [json.loads(line) for line in (tmp_path / "held.telemetry.jsonl").read_text().splitlines()]
    failures = [r for r in records if r["kind"] == "event" and r["event"] == "failure"]
    assert len(failures) == 1 and "node node2 (ranks 2, 3)" in failures[0]["detail"], failures
    assert records[-1]["kind"] == "status" and records[-1]["state"] == "failed", records[-1]


DICTLEARN = ["dictlearn", "--atoms", "50", "--iterations", "2000", "--samples", "1500", "--features", "20",
             "--sparsity", "3", "--snr-db", "20", "--progress-every", "0"]  # fmt: skip
TRAIN = ["train", "--epochs", "2", "--batch-size", "60", "--hidden", "32", "--progress-every", "0"]
LOSSES = {"dictlearn": (DICTLEARN, 250), "train": (TRAIN, 10)}  # settings, checkpoint every


def _weights(path: Path) -> dict[str, np.ndarray]:
    """What a dictlearn or train results file learned: the dictionary, or every weight of the model."""
    with h5py.File(path, "r") as file:
        if "dictionary" in file:
            return {"dictionary": file["dictionary"][()]}
        return {name: file["model"][name][()] for name in file["model"]}


def _checkpointed(directory: Path) -> int:
    latest = directory / "latest"
    return int(latest.read_text()) if latest.exists() else 0


# make test keeps the node-level tests within four minutes: the train run of this test goes to make test-slow
@pytest.mark.parametrize("job", ["dictlearn", pytest.param("train", marks=pytest.mark.slow)])
def test_a_job_with_node_local_checkpoints_loses_a_node_and_resumes_from_partner_copies(nodes, tmp_path, job):
    """4 ranks on node1 and node2, checkpoints on the node-local disks only (--shared-every 0: each shard on its
    node, a copy on the other node); node2 killed whole after a checkpoint, its disk with it. The job ends naming
    node2; rerun on the nodes that remain (node1, node3) it restores from node1's own shards and partner copies and
    ends with the uninterrupted run's result, bit for bit."""
    settings, every = LOSSES[job]
    cli = [sys.executable, "-m", "mpiscale.cli", *settings]
    assert_ok(across(4, [*cli, "--out", str(tmp_path / "reference.h5")], f"the uninterrupted {job}", timeout=180))
    checkpoints = tmp_path / "checkpoints"
    durable = [*cli, "--out", str(tmp_path / "run.h5"), "--checkpoint-dir", str(checkpoints), "--checkpoint-every",
               str(every), "--local-dir", LOCAL, "--shared-every", "0", "--resume"]  # fmt: skip
    environment = SESSION_ENVIRONMENT | {"PYTHONUNBUFFERED": "1", "MPISCALE_TELEMETRY": "0"}
    try:
        first = subprocess.Popen(mpirun(4, durable), env=environment, cwd=REPO, text=True, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and first.poll() is None and _checkpointed(checkpoints) < every:
            time.sleep(0.05)
        assert first.poll() is None and _checkpointed(checkpoints) >= every, "no checkpoint before the end"
        assert cluster("kill", "node2").returncode == 0
        ended = finish(first, f"the {job} after node2 was killed", 90)
        assert ended.returncode != 0
        assert "hpc/cluster/mpirun: node node2 went down while the job ran" in ended.stderr, ended.output[-4000:]
        assert not list(checkpoints.glob("step-*.h5")), "--shared-every 0 wrote a shared checkpoint"
        again = across(4, durable, f"the {job} rerun on node1 and node3", timeout=180)
        assert_ok(again)
        restored = re.search(r"restored checkpoint step (\d+) from \{\d+: '([a-z+]+)'\}", again.stderr)
        assert restored and int(restored[1]) >= every and restored[2] == "local+partner", again.stderr[-3000:]
        with h5py.File(tmp_path / "run.h5", "r") as run:
            assert run.attrs["hosts"] == '["node1", "node3"]'
        reference, result = _weights(tmp_path / "reference.h5"), _weights(tmp_path / "run.h5")
        for name, values in reference.items():
            np.testing.assert_array_equal(result[name], values, err_msg=name)
    finally:
        cluster("up", str(NODES))  # the whole cluster again for the tests after this one (afresh: node2 is gone)


SLURM_CONF = Path("/run/mpiscale-cluster/slurm/slurm.conf")
TEMPLATE = REPO / "hpc" / "slurm" / "dictlearn.sbatch"
TEMPLATE_SETTINGS = {
    "MPISCALE_HOME": str(REPO), "ATOMS": "50", "ITERATIONS": "2000", "CHECKPOINT_EVERY": "250",
    "OPTIONS": "--samples 1500 --features 20 --sparsity 3 --snr-db 20 --progress-every 0",
    "MPISCALE_TELEMETRY_INTERVAL_S": "0.5",
}  # fmt: skip
_references: dict[str, dict[str, np.ndarray]] = {}


def _reference(job: str, directory: Path) -> dict[str, np.ndarray]:
    """What ``job`` learns uninterrupted on 4 ranks over node1 and node2 (run once per module)."""
    if job not in _references:
        out = directory / f"{job}-reference.h5"
        cli = [sys.executable, "-m", "mpiscale.cli", *LOSSES[job][0], "--out", str(out)]
        assert_ok(across(4, cli, f"the uninterrupted {job}", timeout=180))
        _references[job] = _weights(out)
    return _references[job]


@pytest.fixture
def scheduler(nodes):
    """The cluster's own Slurm (cluster.sh starts it where Slurm is installed)."""
    if not SLURM_CONF.exists():
        if os.environ.get("MPISCALE_REQUIRE_CLUSTER") == "1":
            pytest.fail("MPISCALE_REQUIRE_CLUSTER=1 but the cluster has no Slurm (launch/setup.sh installs it)")
        pytest.skip("Slurm is not installed here: the cluster has no scheduler")
    return Controller(SLURM_CONF)


def _submit(scheduler: Controller, run: Path, *options: str, **settings: str) -> str:
    """hpc/slurm/dictlearn.sbatch on 2 nodes of 2 tasks, writing to ``run``."""
    env = {**TEMPLATE_SETTINGS, "RUN": str(run), **settings}
    return scheduler.submit(TEMPLATE, "--nodes=2", "--ntasks-per-node=2", *options, cwd=run.parent, env=env)


def _output(run: Path, job: str) -> str:
    return (run.parent / f"mpiscale-dictlearn-{job}.out").read_text()


def _until_checkpoint(scheduler: Controller, job: str, run: Path, step: int) -> None:
    checkpoints = run / "checkpoints"
    scheduler.wait(
        job, 120, until=lambda j: _checkpointed(checkpoints) >= step or j.state not in ("PENDING", "RUNNING")
    )
    assert _checkpointed(checkpoints) >= step, f"job {job} ended before its checkpoint of iteration {step}"


def _nodes_reported(run: Path) -> set[str]:
    """The hosts that the job's metrics records have named so far, once every rank of the 4 reported (its telemetry
    file, as ``mpiscale watch`` reads; a node whose second rank had not reported showed as "node2 (ranks 2)")."""
    telemetry = run / "dictionary.h5.telemetry.jsonl"
    lines = telemetry.read_text().split("\n")[:-1] if telemetry.exists() else []  # a last line half written: left
    records = [json.loads(line) for line in lines]
    every = [r for r in records if r["kind"] == "metrics" and r["ranks_reporting"] == 4]  # a node's ranks all named
    return {node["host"] for r in every for node in r["nodes"]}


def _assert_learned(run: Path, tmp_path: Path) -> None:
    with h5py.File(run / "dictionary.h5", "r") as file:
        assert file.attrs["iterations"] == 2000 and file.attrs["world_size"] == 4
    np.testing.assert_array_equal(_weights(run / "dictionary.h5")["dictionary"],
                                  _reference("dictlearn", tmp_path)["dictionary"])  # fmt: skip


@pytest.mark.parametrize("launcher", ["srun", pytest.param("mpirun", marks=pytest.mark.slow)])  # make test-slow
def test_sbatch_runs_a_job_across_two_nodes_with_either_launch_line(scheduler, tmp_path, launcher):
    """sbatch -N 2 of the dictlearn template: srun --mpi=pmix, or mpirun inside the allocation (its daemons started
    by srun on each node), runs 2 ranks on each host and learns what mpirun from outside does."""
    run = tmp_path / "run"
    job = _submit(scheduler, run, MPISCALE_LAUNCHER=launcher)
    finished = scheduler.wait(job, 150)
    assert finished.state == "COMPLETED" and finished.exit_code == "0:0", (finished.fields, _output(run, job)[-3000:])
    assert finished.fields["NodeList"] == "node[1-2]" and f"mpiscale-run: {launcher} " in _output(run, job)
    with h5py.File(run / "dictionary.h5", "r") as file:
        assert file.attrs["hosts"] == '["node1", "node2"]'
    _assert_learned(run, tmp_path)


# node1 (the batch host): in about 1 run of 3 no node2 rank writes the failure (the job stays COMPLETING). With each
# rank's stderr kept on its node and a thread in each writing the main thread's stack every 20 ms, node2's ranks were
# seen to stop at the very instant of node1's kill (on the compiled and the pure message path alike), print nothing,
# and end about 1 s later (Slurm's PMIx server lost them): no code of theirs runs after the kill, so the node watch
# cannot speak. What stops them is not found; out of make test until it is (make test-slow runs it)
BATCH_HOST_LOST = pytest.param("node1", "0, 1", "node[2-3]", marks=pytest.mark.slow)


@pytest.mark.parametrize("lost, ranks, remain", [("node2", "2, 3", "node[1,3]"), BATCH_HOST_LOST])
def test_a_node_lost_under_slurm_is_named_and_the_job_resumes_on_the_nodes_that_remain(
    scheduler, tmp_path, lost, ranks, remain
):
    """A node killed whole (its ranks, its slurmd, its disk) under the template with node-local checkpoints only.
    Node2: the job ends at once with one line naming it (the node watch: srun itself waits for Slurm to declare the
    node dead). Node1, the batch host with rank 0 and srun: the job's output goes with it, and a rank of node2
    writes the failure to the job's telemetry in rank 0's place; the requeued run says it on its start. Slurm
    requeues the job onto the nodes that remain, it restores from the own shards and partner copies there, and
    learns the uninterrupted dictionary bit for bit. Telemetry and ``mpiscale watch`` name the node too, and watch
    showed a line per node while the job ran."""
    run = tmp_path / "run"
    options = f"{TEMPLATE_SETTINGS['OPTIONS']} --local-dir {LOCAL} --shared-every 0"
    job = _submit(scheduler, run, OPTIONS=options)
    _until_checkpoint(scheduler, job, run, 250)
    # the job's telemetry (every 0.5 s) has named both nodes: 250 iterations can take less than one interval
    running = scheduler.wait(
        job, 30, until=lambda j: _nodes_reported(run) >= {"node1", "node2"} or j.state != "RUNNING"
    )
    # still the first run: one that failed by itself and was requeued is a defect of its own, not the node's loss
    assert running.state == "RUNNING" and running.restarts == 0, (running.fields, _output(run, job)[-4000:])
    said = f"node {lost} (ranks {ranks}) was lost while the job ran"
    try:
        killed = time.monotonic()
        assert cluster("kill", lost).returncode == 0
        scheduler.wait(job, 30, until=lambda j: said in _telemetry(run))
        named = time.monotonic() - killed
        resumed = scheduler.wait(job, 120, until=lambda j: "resumed from the checkpoint" in _output(run, job))
        back = time.monotonic() - killed
        finished = scheduler.wait(job, 150)
    finally:
        cluster("up", str(NODES))
    text = _output(run, job)
    assert finished.state == "COMPLETED" and finished.restarts >= 1, (finished.fields, text[-4000:])
    assert finished.fields["NodeList"] == remain, (resumed.fields, finished.fields)
    if lost == "node2":  # the job's own stderr, from node1's ranks
        assert text.count(said) == 2 and f"mpiscale: rank 0: {said}" in text, text[-6000:]
    else:  # the batch host's output is gone: the requeued run says why the last one failed
        assert text.count(said) == 1, text[-6000:]
    assert f"mpiscale: restart 1 of this job: its previous run failed: {said}" in text, text[-6000:]
    assert re.search(r"restored checkpoint step \d+ from \{\d+: 'local\+partner'\}", text), text[-3000:]
    _assert_learned(run, tmp_path)
    lines = (run / "dictionary.h5.telemetry.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    failures = [r for r in records if r.get("event") == "failure"]
    assert len(failures) == 1 and said in failures[0]["detail"], failures
    restarted = [r for r in records if r.get("event") == "restarted"]
    assert len(restarted) == 1 and said in restarted[0]["detail"], restarted
    # what `mpiscale watch` showed when the first run ended (the file then goes on with the requeued run's records)
    failed = next(k for k, r in enumerate(records) if r["kind"] == "status" and r["state"] == "failed")
    (tmp_path / "first.telemetry.jsonl").write_text("\n".join(lines[: failed + 1]) + "\n")
    watched = subprocess.run([sys.executable, "-m", "mpiscale.cli", "watch", "--file",
                              str(tmp_path / "first.telemetry.jsonl"), "--no-follow"],
                             capture_output=True, text=True, timeout=60, cwd=REPO)  # fmt: skip
    assert watched.returncode == 1 and said in watched.stdout and ", failed" in watched.stdout, watched.stdout
    assert "node node1 (ranks 0-1): step " in watched.stdout and "node node2 (ranks 2-3): step " in watched.stdout, (
        watched.stdout + "\n".join(lines[max(0, failed - 12) : failed + 1])
    )
    print(f"{lost} killed: named after {named:.1f} s, the requeued job resumed on {remain} after {back:.1f} s")


def _telemetry(run: Path) -> str:
    telemetry = run / "dictionary.h5.telemetry.jsonl"
    return telemetry.read_text() if telemetry.exists() else ""


def test_a_node_an_admin_sets_down_stays_down_until_resumed(scheduler):
    """ReturnToService=2 returned node2 to service as soon as its slurmd registered again (35 ms after scontrol set
    it DOWN, for a node that came back), so a requeued job landed on it again (issue 59, item 17)."""
    scheduler.run(["scontrol", "update", "nodename=node2", "state=DOWN", "reason=maintenance"])
    try:
        pid_file = SLURM_CONF.parent / "slurmd-node2.pid"
        os.kill(int(pid_file.read_text()), signal.SIGTERM)  # the node's slurmd restarts, as on a node's reboot
        deadline = time.monotonic() + 30
        while pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert on_node("node2", f"/usr/sbin/slurmd -f {SLURM_CONF}").returncode == 0
        time.sleep(3)  # it registers within this
        shown = scheduler.run(["scontrol", "show", "node", "node2"]).stdout
        assert "State=DOWN" in shown and "Reason=maintenance" in shown, shown
    finally:
        scheduler.run(["scontrol", "update", "nodename=node2", "state=RESUME"])
    deadline = time.monotonic() + 30
    while "State=IDLE" not in (shown := scheduler.run(["scontrol", "show", "node", "node2"]).stdout):
        assert time.monotonic() < deadline, shown
        time.sleep(0.2)


def test_the_time_limit_signal_reaches_every_nodes_ranks_and_the_job_resumes(scheduler, tmp_path):
    """What --signal=B:USR1@120 sends before the limit (here by hand): the ranks of both nodes stop after the same
    iteration with one checkpoint, the job is requeued and resumes from it to the uninterrupted dictionary."""
    run = tmp_path / "run"
    job = _submit(scheduler, run, "--time=UNLIMITED")
    _until_checkpoint(scheduler, job, run, 250)
    scheduler.run(["scancel", "--signal=USR1", "--batch", job])
    finished = scheduler.wait(job, 150)
    text = _output(run, job)
    # the output as text, whole (a tuple's repr is cut short in the report: L4's failure showed one line of it)
    assert finished.state == "COMPLETED" and finished.restarts == 1, f"{finished.fields}\n{text}{scheduler.logs()}"
    for rank in range(4):
        assert f"mpiscale: rank {rank}: SIGTERM received, stopping after the current step with a checkpoint" in text
    stops = re.findall(r"stopped on request \(a stop command or SIGTERM\) after iteration (\d+);", text)
    assert len(stops) == 1 and f"resumed from the checkpoint of iteration {stops[0]} in {run}/checkpoints" in text
    _assert_learned(run, tmp_path)


def test_scancel_stops_the_ranks_on_every_node(scheduler, tmp_path):
    """A plain scancel of a job on node1 and node2: every rank stops with a checkpoint, and no process of the job
    is left on either node."""
    run = tmp_path / "run"
    job = _submit(scheduler, run)
    _until_checkpoint(scheduler, job, run, 250)
    scheduler.run(["scancel", job])
    stopped = scheduler.wait(job, 90)
    assert stopped.state == "CANCELLED" and stopped.restarts == 0, stopped.fields
    records = [json.loads(line) for line in (run / "dictionary.h5.telemetry.jsonl").read_text().splitlines()]
    assert records[-1]["kind"] == "status" and records[-1]["state"] == "stopped", records[-3:]
    step = int(records[-2]["detail"].split("iteration ")[1].split(",")[0])
    assert _checkpointed(run / "checkpoints") == step
    for node in ("node1", "node2"):
        left = on_node(node, f"ps -eo args | grep -c '[m]piscale dictlearn.*{run}' || true").stdout.strip()
        assert left == "0", f"{left} processes of the job left on {node}"


def test_node_local_disks_are_private_and_a_killed_node_takes_its_own(nodes):
    """A file on node1's node-local disk is on no other node nor on the machine; killing node3 kills its processes
    and its disk, and leaves the others running."""
    assert on_node("node1", f"echo shard > {LOCAL}/mine && cat {LOCAL}/mine").stdout == "shard\n"
    assert on_node("node2", f"cat {LOCAL}/mine").returncode != 0
    assert not Path(LOCAL, "mine").exists()
    assert on_node("node3", "sleep 300 >/dev/null 2>&1 & echo started").returncode == 0
    killed = cluster("kill", "node3")
    assert killed.returncode == 0, killed.stderr
    assert "node3 " in cluster("status").stdout and "node3 10.77.0.13 down" in cluster("status").stdout
    assert subprocess.run(["ip", "netns", "pids", "mpiscale-node3"], capture_output=True, text=True).stdout == ""
    assert on_node("node1", f"cat {LOCAL}/mine").stdout == "shard\n"


def test_up_refuses_to_replace_a_running_cluster_of_another_size_or_an_empty_count(nodes):
    """`up 2` while 3 nodes ran took the cluster down without a word, with its jobs and node-local data; `up ''`
    was taken as `up 3`."""
    whole = cluster("up", str(NODES))  # an earlier test may have left a node killed: the whole cluster, running
    assert whole.returncode == 0, whole.stderr
    other = cluster("up", str(NODES - 1))
    assert other.returncode == 2 and f"a cluster of {NODES} nodes is up" in other.stderr, other.stderr
    assert "run 'hpc/cluster/cluster.sh down' first" in other.stderr
    empty = cluster("up", "")
    assert empty.returncode == 2 and "up takes a number of nodes from 1 to 99, got ''" in empty.stderr, empty.stderr
    status = cluster("status")
    assert status.returncode == 0 and all(f"node{k}" in status.stdout for k in range(1, NODES + 1)), status.stdout


def test_two_ups_at_once_take_turns_and_leave_one_set_of_daemons(nodes):
    """Two sessions bringing the cluster up at the same moment: the second waits for the first and finds it up, so
    one munged, one slurmctld and one slurmd per node run, each named by its pid file, and none of the processes left
    running holds the commands' lock (a later down would wait for it)."""
    cluster("down")
    ups = [subprocess.Popen([str(CLUSTER / "cluster.sh"), "up", str(NODES)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for _ in range(2)]  # fmt: skip
    said = [up.communicate(timeout=120) for up in ups]
    assert [up.returncode for up in ups] == [0, 0], said
    assert sorted("already up" in out for out, _ in said) == [False, True], said
    daemons = [line.split()[1] for line in subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True)
               .stdout.splitlines() if "/run/mpiscale-cluster/" in line]  # fmt: skip
    assert sorted(Path(d).name for d in daemons) == ["munged", "slurmctld", *["slurmd"] * NODES], daemons
    lock = Path("/run/mpiscale-cluster.lock").resolve()
    holding = [p.name for p in Path("/proc").iterdir() if p.name.isdigit() and _holds(p, lock)]
    assert not holding, holding


def _holds(process: Path, lock: Path) -> bool:
    try:
        return any(fd.resolve() == lock for fd in (process / "fd").iterdir())
    except OSError:  # it ended while it was read
        return False


def test_the_cluster_is_refused_without_root_and_tears_down_leaving_nothing(nodes):
    """Not root: one line, exit 2, nothing made. Down (within 10 s): no namespace, bridge, /etc/hosts line, holder
    process, Slurm daemon (slurmctld, munged, a node's slurmd) or run directory left; a second down has nothing to
    do."""
    nobody = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(CLUSTER / "cluster.sh"),
                             "up", "2"], capture_output=True, text=True, timeout=30)  # fmt: skip
    assert nobody.returncode == 2 and "must run as root" in nobody.stderr, nobody.stderr
    holders = [int(path.read_text()) for path in Path("/run/mpiscale-cluster").glob("node*.pid")]
    assert len(holders) == NODES
    began = time.monotonic()
    down = cluster("down")
    assert down.returncode == 0 and time.monotonic() - began < 10
    assert "mpiscale-node" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert subprocess.run(["ip", "link", "show", "mpiscale-br0"], capture_output=True).returncode != 0
    assert "mpiscale-cluster" not in Path("/etc/hosts").read_text()
    assert not Path("/run/mpiscale-cluster").exists()
    assert not [pid for pid in holders if alive(pid)], holders
    daemons = [line for line in subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
               .splitlines() if "/run/mpiscale-cluster/" in line]  # fmt: skip
    assert not daemons, f"Slurm's daemons of the cluster outlived it: {daemons}"
    assert cluster("status").returncode == 1 and cluster("down").returncode == 0


def _iterations(log: Path) -> int:
    """The last iteration a memory-store run's progress lines reported (0: none yet)."""
    done = re.findall(r"^iteration (\d+)/", log.read_text(), re.MULTILINE)
    return int(done[-1]) if done else 0
