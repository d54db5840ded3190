"""The local multi-node cluster (``hpc/cluster/``): separate hosts, networks and node-local disks on one machine.

Each node is a network, UTS and mount namespace with its own hostname, an address on a private bridge and a private
tmpfs; Open MPI starts its daemons there through ``hpc/cluster/enter`` and talks TCP between the nodes. The module
brings up 3 nodes once and tears them down at its end (its last test checks that nothing is left). Where namespaces
cannot be made (not root, a container that refuses them) the module is skipped, saying why; under
``MPISCALE_REQUIRE_CLUSTER=1`` it fails instead.
"""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers import PROGRAMS, REPO, SESSION_ENVIRONMENT, Job, assert_ok, finish
from memstore_files import assert_same, results

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


def across(ranks: int, command: list[str], what: str, timeout: float = 120, env: dict | None = None) -> Job:
    """``command`` on ``ranks`` ranks over the cluster's nodes, 2 per node, with a hard timeout."""
    environment = SESSION_ENVIRONMENT | {"PYTHONUNBUFFERED": "1", "MPISCALE_TELEMETRY": "0"} | (env or {})
    process = subprocess.Popen([str(CLUSTER / "mpirun"), "-n", str(ranks), "--", *command], env=environment,
                               cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True)  # fmt: skip
    return finish(process, what, timeout)


def on_node(node: str, command: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(CLUSTER / "enter"), node, command], capture_output=True, text=True, timeout=30)


PLACEMENT = """
import socket
import mpiscale

async def main(system):
    h = system.hierarchy
    rows = system.world.comm.allgather((system.rank, socket.gethostname(), h.node_index, h.node_count, h.node.rank,
                                        h.leaders is not None))
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
    again = cluster("up", str(NODES))  # idempotent
    assert again.returncode == 0 and "already up" in again.stdout


def test_ranks_run_on_separate_hosts_and_the_node_communicators_follow_them(nodes):
    """6 ranks, 2 per node: each node's ranks see their own hostname; the runtime finds 3 nodes of 2 from the
    hosts themselves (no MPISCALE_RANKS_PER_NODE), with the first rank of each leading it."""
    job = across(6, [sys.executable, "-c", PLACEMENT], "placement on 3 nodes")
    assert_ok(job)
    rows = [line.split()[1:] for line in job.stdout.splitlines() if line.startswith("placed")]
    assert [(r[1], r[2], r[3], r[4], r[5]) for r in rows] == [
        (f"node{k // 2 + 1}", str(k // 2), "3", str(k % 2), str(k % 2 == 0)) for k in range(6)
    ], job.stdout


@pytest.mark.parametrize("ranks", [4, 6])
def test_the_hierarchical_allreduce_across_hosts_matches_numpy(nodes, ranks):
    """programs/hierarchical.py over TCP between 2 and 3 hosts: sums, every dtype and op it checks, the same bits
    on every rank."""
    job = across(ranks, [sys.executable, str(PROGRAMS / "hierarchical.py")], f"hierarchical on {ranks} ranks")
    assert_ok(job)
    assert f"hierarchical allreduce ok: {ranks} ranks, {ranks // 2} nodes" in job.stdout, job.stdout


def test_training_across_hosts_follows_one_process(nodes, tmp_path):
    """mpiscale train on 4 ranks over 2 hosts (parallel HDF5 on the shared file system, gradients over TCP)
    against one rank: the same weights within rounding."""
    settings = ["train", "--epochs", "1", "--batch-size", "60", "--hidden", "32", "--progress-every", "0"]
    cli = [sys.executable, "-m", "mpiscale.cli"]
    assert_ok(across(1, [*cli, *settings, "--out", str(tmp_path / "one.h5")], "train on 1 rank"))
    assert_ok(across(4, [*cli, *settings, "--out", str(tmp_path / "four.h5")], "train on 2 hosts"))
    with h5py.File(tmp_path / "one.h5", "r") as one, h5py.File(tmp_path / "four.h5", "r") as four:
        assert four.attrs["hosts"] == '["node1", "node2"]' and one.attrs["hosts"] == '["node1"]'
        for name in one["model"]:
            np.testing.assert_allclose(four["model"][name][()], one["model"][name][()], rtol=1e-4, atol=1e-5)


STORE = ["memstore", "--records", "60000", "--iterations", "200", "--top", "20", "--checkpoint-every", "10"]


def test_a_memory_store_loses_nothing_when_a_whole_node_is_lost(nodes, tmp_path):
    """4 ranks on node1 and node2, node-local logs and checkpoint shards on each node's own disk (partner copies on
    the other node); node2 killed whole mid-run, its disk with it. The job ends; rerun on the nodes that remain
    (node1, node3) it recovers from node1's partner copies and ends with every record and every iteration's
    aggregates and top-k equal, bit for bit, to one uninterrupted rank."""
    cli = [sys.executable, "-m", "mpiscale.cli"]
    reference = tmp_path / "reference.h5"
    assert_ok(across(1, [*cli, *STORE, "--out", str(reference)], "the uninterrupted store"))
    durable = [*STORE, "--out", str(tmp_path / "store.h5"), "--checkpoint-dir", str(tmp_path / "checkpoints"),
               "--local-dir", LOCAL, "--progress-every", "0.1"]  # fmt: skip
    environment = SESSION_ENVIRONMENT | {"PYTHONUNBUFFERED": "1", "MPISCALE_TELEMETRY": "0"}
    log = tmp_path / "first.log"
    try:
        with open(log, "w") as output:
            first = subprocess.Popen([str(CLUSTER / "mpirun"), "-n", "4", "--", *cli, *durable], env=environment,
                                     cwd=REPO, text=True, stdout=output, stderr=subprocess.STDOUT,
                                     start_new_session=True)  # fmt: skip
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and first.poll() is None and _iterations(log) < 40:
                time.sleep(0.05)
            assert first.poll() is None, log.read_text()[-4000:]
            killed = time.time()
            assert cluster("kill", "node2").returncode == 0
            ended = finish(first, "the store after node2 was killed", 90)
        assert ended.returncode != 0, log.read_text()[-4000:]
        again = across(4, [*cli, *durable], "the store rerun on node1 and node3", timeout=180)
        assert_ok(again)
        run = results(tmp_path / "store.h5")
        assert "(local+partner)" in run[2]["source"] and "partner copies" in run[2]["source"], run[2]
        assert_same(run, results(reference), records=60000, iterations=200)
        print(f"node2 killed to the rerun's first iteration: {run[2]['resumed_at'] - killed:.1f} s (the job's end, "
              f"the relaunch and recovery included); recovery itself {run[2]['seconds']['total']:.2f} s")  # fmt: skip
    finally:
        cluster("up", str(NODES))  # the whole cluster again for the tests after this one (afresh: node2 is gone)


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


@pytest.mark.parametrize("job", sorted(LOSSES))
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
        first = subprocess.Popen([str(CLUSTER / "mpirun"), "-n", "4", "--", *durable], env=environment, cwd=REPO,
                                 text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 start_new_session=True)  # fmt: skip
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


def test_the_cluster_is_refused_without_root_and_tears_down_leaving_nothing(nodes):
    """Not root: one line, exit 2, nothing made. Down (within 10 s): no namespace, bridge, /etc/hosts line, holder
    process or run directory left; a second down has nothing to do."""
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
    assert not [pid for pid in holders if _running(pid)], holders
    assert cluster("status").returncode == 1 and cluster("down").returncode == 0


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _iterations(log: Path) -> int:
    """The last iteration a memory-store run's progress lines reported (0: none yet)."""
    done = re.findall(r"^iteration (\d+)/", log.read_text(), re.MULTILINE)
    return int(done[-1]) if done else 0
