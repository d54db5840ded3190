"""The write-ahead log: round trips, a torn last record (a process killed mid-append), damage earlier in the file."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from mpiscale.io import DataFileError, ReplayReport, WriteAheadLog, replay


def batch(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {"ids": rng.integers(0, 2**62, 50 + step), "deltas": rng.normal(size=50 + step).astype(np.float32),
            "table": rng.random((3, 4)).astype(np.float32), "empty": np.empty(0, np.int64)}  # fmt: skip


def assert_same(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        assert got[name].dtype == expected[name].dtype and np.array_equal(got[name], expected[name]), name


def test_records_come_back_in_order_and_appending_continues(tmp_path):
    path = tmp_path / "log"
    with WriteAheadLog(path) as log:
        for step in range(3):
            log.append(step, batch(step))
    with WriteAheadLog(path) as log:  # reopened: appends after the existing records
        assert log.report.records == 3 and log.report.torn_bytes == 0
        log.append(3, batch(3))
    report = ReplayReport()
    records = list(replay(path, report))
    assert [step for step, _ in records] == [0, 1, 2, 3] and report.records == 4
    for step, arrays in records:
        assert_same(arrays, batch(step))
    with WriteAheadLog(path) as log:
        log.reset()
    assert list(replay(path)) == []


def test_a_torn_last_record_is_dropped_reported_and_cut_off(tmp_path):
    """The last record cut inside its 8-byte frame, then inside its body: dropped, reported, cut off on reopening."""
    path = tmp_path / "log"
    with WriteAheadLog(path) as log:
        for step in range(3):
            log.append(step, batch(step))
        last_starts = os.path.getsize(path)
        log.append(3, batch(3))
    for keep in (3, 100):  # bytes of the last record left
        os.truncate(path, last_starts + keep)
        report = ReplayReport()
        assert [step for step, _ in replay(path, report)] == [0, 1, 2] and report.torn_bytes == keep
        with WriteAheadLog(path) as log:
            assert log.report.torn_bytes == keep
            log.append(3, batch(3))
        records = list(replay(path))
        assert [step for step, _ in records] == [0, 1, 2, 3]
        assert_same(records[3][1], batch(3))


def test_damage_before_the_end_names_the_file_and_the_record(tmp_path):
    path = tmp_path / "log"
    with WriteAheadLog(path) as log:
        for step in range(3):
            log.append(step, batch(step))
    data = bytearray(path.read_bytes())
    data[40] ^= 0xFF  # inside the first record's body
    path.write_bytes(bytes(data))
    with pytest.raises(DataFileError, match=r"log: the record at byte 8 fails its checksum and \d+ bytes follow"):
        list(replay(path))
    with pytest.raises(DataFileError, match="the record at byte 8"):
        WriteAheadLog(path)
    path.write_bytes(b"NOTALOG!" + bytes(data[8:]))
    with pytest.raises(DataFileError, match="not a write-ahead log"):
        list(replay(path))


WRITER = """
import sys
import numpy as np
from mpiscale.io import WriteAheadLog
with WriteAheadLog(sys.argv[1]) as log:
    step = 0
    while True:
        log.append(step, {"values": np.full(20000, step, np.int64)})
        step += 1
        if step == 5:
            print("running", flush=True)
"""


def test_a_process_killed_while_appending_leaves_a_log_that_replays(tmp_path):
    """SIGKILL at an arbitrary moment: every complete record replays, steps without gaps, and the log goes on."""
    path = tmp_path / "log"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "running"
    time.sleep(0.3)
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=30)
    report = ReplayReport()
    steps = [step for step, arrays in replay(path, report) if (arrays["values"] == step).all()]
    assert steps == list(range(report.records)) and report.records >= 5
    with WriteAheadLog(path) as log:
        log.append(report.records, {"values": np.full(3, report.records, np.int64)})
    assert [step for step, _ in replay(path)] == list(range(report.records + 1))
