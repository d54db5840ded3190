"""The node sentry, a real process beside a real rank-like process, against a real TCP peer standing in for the
next host: a rank that answers reports a lost node itself; a rank whose Python is held (a C call that keeps the
GIL, as h5py's MPI-IO open does while it waits for a lost node's ranks) has the line and the telemetry failure event
said for it by its sentry, which then kills it; a rank that said its end was coming is left alone."""

import json
import socket
import subprocess
import sys
import time

RANK = """
import asyncio, ctypes, sys
from mpiscale.runtime.node_sentry import NodeSentry
from mpiscale.runtime.node_watch import listening_socket

port, mode, telemetry = int(sys.argv[1]), sys.argv[2], sys.argv[3]


async def main():
    sentry = NodeSentry.spawn(listening_socket(), 0, ["node2", [2, 3], ["127.0.0.1"], port], None, None)
    sentry.leave_last_words("mpiscale.telemetry.last_words",
                            {"job": "j1", "command": "test", "ranks": 4, "rank": 0, "file": telemetry})
    found = asyncio.Event()

    def on_lost(node):
        print(f"the rank reports {node.host}", flush=True)
        found.set()

    sentry.start(on_lost)
    if mode == "quiet":
        sentry.quiet()
    if mode == "exits":
        await asyncio.sleep(1.0)  # the sentry has started and connected
    elif mode in ("held", "quiet"):
        ctypes.PyDLL(None).sleep(3)  # a C call that keeps the GIL: nothing else of this process's Python runs
    elif mode == "answers":
        await asyncio.wait_for(found.wait(), 10)
    sentry.close()


asyncio.run(main())
"""


def _rank(tmp_path, mode: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """The rank-like process in ``mode``, its next host (this test) lost once the sentry is connected."""
    peer = socket.socket()
    peer.bind(("127.0.0.1", 0))
    peer.listen(4)
    telemetry = tmp_path / "job.telemetry.jsonl"
    rank = subprocess.Popen([sys.executable, "-c", RANK, str(peer.getsockname()[1]), mode, str(telemetry)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    peer.settimeout(20)
    connection, _ = peer.accept()  # the sentry watches this host
    time.sleep(0.2)
    peer.close()  # gone: the connection ends and nothing answers the sentry's probe
    connection.close()
    out, err = rank.communicate(timeout=30)
    records = [json.loads(line) for line in telemetry.read_text().splitlines()] if telemetry.exists() else []
    return subprocess.CompletedProcess(rank.args, rank.returncode, out, err), records


def test_a_held_rank_has_its_lost_node_said_by_its_sentry_which_ends_it(tmp_path):
    ended, records = _rank(tmp_path, "held")
    assert ended.returncode == -9, ended
    named = [line for line in ended.stderr.splitlines() if "node2" in line]
    assert len(named) == 1 and named[0].startswith("mpiscale: rank 0: node node2 (ranks 2, 3) was lost"), ended.stderr
    assert "the rank was held" in named[0]
    assert [(r["kind"], r.get("event"), r.get("state")) for r in records] == [
        ("event", "failure", None), ("status", None, "failed")], records  # fmt: skip
    assert "node node2 (ranks 2, 3) was lost" in records[0]["detail"] and records[0]["rank"] == 2


def test_a_rank_that_answers_reports_the_lost_node_itself(tmp_path):
    ended, records = _rank(tmp_path, "answers")
    assert ended.returncode == 0, ended
    assert ended.stdout == "the rank reports node2\n" and ended.stderr == "", ended  # nothing of the sentry's
    assert records == []


def test_a_rank_whose_end_began_is_left_alone_even_held(tmp_path):
    ended, records = _rank(tmp_path, "quiet")
    assert ended.returncode == 0 and ended.stderr == ended.stdout == "", ended
    assert records == []


def test_a_rank_that_exits_on_purpose_has_its_sentry_say_farewell_to_the_next_host(tmp_path):
    peer = socket.socket()
    peer.bind(("127.0.0.1", 0))
    peer.listen(4)
    rank = subprocess.Popen([sys.executable, "-c", RANK, str(peer.getsockname()[1]), "exits", str(tmp_path / "t")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    peer.settimeout(20)
    connection, _ = peer.accept()
    connection.settimeout(20)
    said = b""
    while chunk := connection.recv(16):  # until the sentry closes it: the farewell comes first
        said += chunk
    out, err = rank.communicate(timeout=30)
    assert said == b"F" and rank.returncode == 0 and out == err == "", (said, out, err)
