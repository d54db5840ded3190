"""Checkpoints under real MPI jobs: resharding, lost nodes, corruption, deltas, failures, SIGKILL.

Each scenario runs several jobs in a row (save, then restart on another world
size); ``--ranks-per-node`` simulates nodes, each with its own node-local directory.
"""

import json
import os
import re
import shutil
import signal
import sys
import time

import h5py
from helpers import PROGRAMS, assert_ok, finish, launch, run_mpi

PROGRAM = "checkpoint_job.py"


def job(ranks, mode, tmp_path, *steps, per_node=None):
    env = {"MPISCALE_RANKS_PER_NODE": str(per_node)} if per_node else None
    return run_mpi(PROGRAM, ranks, mode, str(tmp_path / "shared"), str(tmp_path / "local"), *map(str, steps), env=env)


def restored(result) -> str:
    assert_ok(result)
    return re.search(r"restored step (\d+) from (.*)", result.stdout).group(0)


def test_reshard_and_lost_nodes(ranks, tmp_path):
    """Save on `ranks` simulated nodes; restart on other sizes, then lose nodes one by one."""
    assert_ok(job(ranks, "save", tmp_path, 1, 2, 3, 4, per_node=1))
    shared = sorted(os.listdir(tmp_path / "shared"))  # keep=2: steps 3 and 4; step 3 also in the shared file
    assert shared == ["latest", "step-00000003.h5", "step-00000003.json", "step-00000004.json"], shared
    other = 3 if ranks == 2 else 2
    assert restored(job(ranks, "load", tmp_path, per_node=1)) == "restored step 4 from {4: 'local'}"
    shutil.rmtree(tmp_path / "local" / "node-1")
    # Node 1's shard comes back from its partner copy on node 0 (or 2), on another world size too
    # (3 nodes: the shards of a 4th node are reached through their copies on node 0).
    assert restored(job(3, "load", tmp_path, per_node=1)) == "restored step 4 from {4: 'local+partner'}"
    for node in range(ranks):
        shutil.rmtree(tmp_path / "local" / f"node-{node}", ignore_errors=True)
    # Step 4 lived only on the nodes: its loss is reported and step 3 comes from the shared file.
    result = job(other, "load", tmp_path, per_node=1)
    assert restored(result) == "restored step 3 from {3: 'shared'}"
    assert "checkpoint step 4 cannot be restored" in result.stderr


def test_corrupt_shard_and_shared_file(tmp_path):
    assert_ok(job(4, "save", tmp_path, 1, 2, 3, per_node=2))
    # Flip bytes inside rank 2's own shard of step 3: its partner copy is used instead.
    shard = tmp_path / "local" / "node-1" / "step-00000003" / "rank-00002.h5"
    _flip_data(shard)
    result = job(2, "load", tmp_path, per_node=1)
    assert restored(result) == "restored step 3 from {3: 'local+partner'}"
    assert "rank-00002.h5 is unusable" in result.stderr and "checksum mismatch" in result.stderr
    # Lose step 3 from the nodes and corrupt its shared file: the previous good checkpoint is used.
    for node in (0, 1):
        shutil.rmtree(tmp_path / "local" / f"node-{node}" / "step-00000003")
    _flip_data(tmp_path / "shared" / "step-00000003.h5")
    result = job(3, "load", tmp_path)
    assert restored(result) == "restored step 2 from {2: 'local+partner'}"
    assert "checkpoint step 3 cannot be restored" in result.stderr and "x: checksum mismatch" in result.stderr
    # With nothing left that verifies, the job fails saying why, instead of silently starting afresh.
    shutil.rmtree(tmp_path / "local")
    result = job(2, "load", tmp_path)
    assert result.returncode != 0
    assert "no usable checkpoint in" in result.stderr and "step 2: shards of step 2 are lost" in result.stderr


def _flip_data(path, name="x"):
    """Corrupt the stored bytes of one array, leaving the HDF5 structure intact."""
    with h5py.File(path, "r") as file:
        offset, size = file[name].id.get_offset(), file[name].id.get_storage_size()
    with open(path, "r+b") as file:
        file.seek(offset + size // 2)
        byte = file.read(1)
        file.seek(offset + size // 2)
        file.write(bytes([byte[0] ^ 0x01]))  # one flipped bit


def test_delta_restores_by_combining(ranks, tmp_path):
    result = job(ranks, "delta", tmp_path, per_node=2)
    assert_ok(result)
    manifest = json.loads((tmp_path / "shared" / "step-00000103.json").read_text())
    assert manifest["base"] == 101 and manifest["arrays"]["x"]["stored_in"] == 101
    assert {manifest["arrays"][n]["stored_in"] for n in ("ids", "w", "lr")} == {103}
    assert not (tmp_path / "shared" / "step-00000102.json").exists()  # keep=1, but base 101 is kept
    # Restart on one node: with 4 writers on 2 nodes, node 1's shards come from their copies on node 0.
    level = "local+partner" if ranks == 4 else "local"
    assert (
        restored(job(3, "load", tmp_path, per_node=3)) == f"restored step 103 from {{101: '{level}', 103: '{level}'}}"
    )
    shutil.rmtree(tmp_path / "local")
    assert restored(job(2, "load", tmp_path)) == "restored step 103 from {101: 'shared', 103: 'shared'}"


def test_background_failure_surfaces_on_every_rank(ranks, tmp_path):
    result = job(ranks, "fail-async", tmp_path)
    assert_ok(result)
    assert sorted(re.findall(r"rank (\d+) saw: level-3 save of step 2 failed", result.stdout)) == [
        str(r) for r in range(ranks)
    ]


def test_ranks_that_disagree_all_refuse(ranks, tmp_path):
    result = job(ranks, "mismatch", tmp_path)
    assert_ok(result)
    assert sorted(re.findall(r"rank (\d+) refused", result.stdout)) == [str(r) for r in range(ranks)]


def test_background_failure_at_exit_fails_the_job(tmp_path):
    result = job(2, "no-close", tmp_path)
    assert result.returncode != 0
    assert "the last checkpoint was NOT saved: level-3 save of step 1 failed" in result.stderr


def test_sigkill_during_save_keeps_previous_checkpoint(ranks, tmp_path):
    env = {"MPISCALE_RANKS_PER_NODE": "1"}
    args = [sys.executable, str(PROGRAMS / PROGRAM), "kill", str(tmp_path / "shared"), str(tmp_path / "local")]
    process = launch(ranks, args, env=env, cwd=tmp_path)
    pid_file, victim, deadline = tmp_path / "shared" / "victim.pid", None, time.monotonic() + 60
    while victim is None and process.poll() is None and time.monotonic() < deadline:
        if pid_file.exists():
            victim = int(pid_file.read_text())
            os.kill(victim, signal.SIGKILL)
        time.sleep(0.005)
    result = finish(process, "checkpoint kill job", 60)
    assert victim is not None and result.returncode != 0, result.output[-5000:]
    assert not (tmp_path / "shared" / "step-00000002.json").exists(), "the kill came too late to test anything"
    assert (tmp_path / "shared" / "latest").read_text().strip() == "1"
    other = 3 if ranks == 2 else 2
    assert restored(job(other, "load", tmp_path, per_node=1)).startswith("restored step 1 from {1: ")
