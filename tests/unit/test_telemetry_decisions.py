"""What rank 0 decides from the ranks' reports, as pure functions: the metrics' spread, the pace, hangs, stragglers."""

import io
import json
import time

import numpy as np
import pytest

from mpiscale.telemetry import Watchdog, WatchdogSettings, by_node, pace, spread
from mpiscale.telemetry.schema import problems, record
from mpiscale.telemetry.sinks import FileSink
from mpiscale.telemetry.watch import GONE_AFTER_S, Screen, View


def report(rank: int, step: int, time: float, wait_s: float = 0.0, waiting_in=None, **metrics) -> dict:
    return {"rank": rank, "step": step, "time": time, "wait_s": wait_s, "waiting_in": waiting_in,
            "host": "h", "pid": 100 + rank, "metrics": metrics}  # fmt: skip


def test_spread_names_the_rank_furthest_behind_and_skips_ranks_without_a_metric():
    values = spread({0: report(0, 9, 0, rss_mib=10.0), 1: report(1, 7, 0, rss_mib=30.0), 2: report(2, 7, 0)})
    assert values["step"] == {"min": 7.0, "mean": pytest.approx(23 / 3), "max": 9.0, "min_rank": 1}
    assert values["rss_mib"] == {"min": 10.0, "mean": 20.0, "max": 30.0, "min_rank": 0}


def test_pace_over_recent_reports():
    assert pace([(0.0, 0, 0.0), (2.0, 10, 500.0)], 30) == (5.0, 250.0, 4.0)
    assert pace([(1.0, 3, 0.0)], 30) == (0.0, 0.0, None)  # one point: no pace, no ETA yet


def test_a_rank_that_stops_advancing_while_the_others_wait_is_a_hang_reported_once():
    watchdog = Watchdog(WatchdogSettings(hang_after_s=10))
    waiting = ("allreduce on world", 6.0)
    assert watchdog.look({0: report(0, 5, 0), 1: report(1, 5, 0)}, 0.0) == []
    reports = {0: report(0, 5, 11, waiting_in=waiting), 1: report(1, 5, 3)}
    found = watchdog.look(reports, 11.0)
    assert [(f.kind, f.rank) for f in found] == [("hang", 1)]
    assert "rank 1 (host h, pid 101) has not advanced for 11 s" in found[0].detail and "ranks [0]" in found[0].detail
    assert watchdog.look(reports, 12.0) == []  # said once


def test_no_hang_while_the_quiet_rank_itself_waits_or_nobody_waits_long():
    watchdog = Watchdog(WatchdogSettings(hang_after_s=10))
    watchdog.look({0: report(0, 5, 0), 1: report(1, 5, 0)}, 0.0)
    both_wait = {r: report(r, 5, 11, waiting_in=("barrier on world", 6.0)) for r in (0, 1)}
    assert watchdog.look(both_wait, 11.0) == []
    short_wait = {0: report(0, 5, 11, waiting_in=("barrier on world", 1.0)), 1: report(1, 5, 3)}
    assert watchdog.look(short_wait, 11.0) == []


def test_a_waiting_rank_whose_report_is_an_interval_old_still_waits_itself():
    """With a hang threshold as short as the report interval, only the rank that stopped reporting is named."""
    watchdog = Watchdog(WatchdogSettings(hang_after_s=2), report_interval_s=2.0)
    watchdog.look({r: report(r, 0, 0) for r in range(3)}, 0.0)
    waiting = ("agreement on world", 3.0)
    reports = {0: report(0, 101, 4, waiting_in=waiting), 1: report(1, 0, 0), 2: report(2, 101, 2, waiting_in=waiting)}
    assert [(f.kind, f.rank) for f in watchdog.look(reports, 4.2)] == [("hang", 1)]


def test_the_ranks_behind_a_stuck_node_leader_are_not_named_but_listed_with_it():
    """Ranks 2 and 3 form a node whose reports go through rank 2: when rank 2 is stuck, rank 3's reports stop too."""
    watchdog = Watchdog(WatchdogSettings(hang_after_s=10))
    watchdog.look({r: {**report(r, 5, 0), "via": r - r % 2} for r in range(4)}, 0.0)
    waiting = ("allreduce on world", 8.0)
    reports = {
        0: report(0, 5, 12, waiting_in=waiting),
        1: {**report(1, 5, 12, waiting_in=waiting), "via": 0},
        2: {**report(2, 5, 1), "via": 2},
        3: {**report(3, 5, 1, waiting_in=("bcast on node", 0.5)), "via": 2},
    }
    found = watchdog.look(reports, 12.0)
    assert [(f.kind, f.rank) for f in found] == [("hang", 2)]
    assert found[0].detail.endswith("; ranks [3] report through it and are unseen since"), found[0].detail
    alive_leader = {**reports, 2: {**report(2, 5, 12, waiting_in=waiting), "via": 2}}  # rank 3 alone is silent
    assert [(f.kind, f.rank) for f in Watchdog(WatchdogSettings(hang_after_s=10)).look(alive_leader, 0.0)] == []
    watchdog = Watchdog(WatchdogSettings(hang_after_s=10))
    watchdog.look({r: {**report(r, 5, 0), "via": r - r % 2} for r in range(4)}, 0.0)
    assert [(f.kind, f.rank) for f in watchdog.look(alive_leader, 12.0)] == [("hang", 3)]


def test_a_rank_whose_last_report_its_stuck_leader_forwarded_was_late_is_still_behind_it():
    """The leader forwards its node's reports on its own tick: under load, rank 3's last forwarded report was 1.1 s
    (over two intervals of 0.5 s) older than rank 2's own last one. Rank 3 fell silent with its leader, so it is listed
    behind rank 2, not named (a CI run named rank 2 alone, its follower neither listed nor named; 2026-12-01). A rank
    that fell silent a hang's length before its leader did is named itself."""

    def watched(follower_last: float, leader_last: float, now: float) -> list:
        watchdog = Watchdog(WatchdogSettings(hang_after_s=8), report_interval_s=0.5)
        watchdog.look({r: {**report(r, 300, 0), "via": r - r % 2} for r in range(4)}, 0.0)
        waiting = ("allgather check on world", now - leader_last)
        return watchdog.look({
            0: report(0, 300, now, waiting_in=waiting), 1: {**report(1, 300, now, waiting_in=waiting), "via": 0},
            2: {**report(2, 300, leader_last), "via": 2},
            3: {**report(3, 300, follower_last, waiting_in=("bcast on node", 0.1)), "via": 2},
        }, now)  # fmt: skip

    found = watched(follower_last=0.9, leader_last=2.0, now=10.5)
    assert [(f.kind, f.rank) for f in found] == [("hang", 2)], found
    assert found[0].detail.endswith("; ranks [3] report through it and are unseen since"), found[0].detail
    found = watched(follower_last=0.9, leader_last=9.0, now=17.5)
    assert sorted((f.kind, f.rank) for f in found) == [("hang", 2), ("hang", 3)], found


def test_a_rank_never_seen_because_its_leader_stuck_first_is_listed_behind_the_leader():
    """Warm ranks reach the rehearsed hang within one interval: rank 2 forwarded its own first report before rank 3's
    reached it, then stuck, so rank 3 was never seen and the hang named rank 2 with no one behind it (2026-12-02)."""
    watchdog = Watchdog(WatchdogSettings(hang_after_s=8), report_interval_s=0.5, leaders=(0, 0, 2, 2))
    watchdog.look({0: report(0, 0, 0), 1: {**report(1, 0, 0), "via": 0}, 2: {**report(2, 0, 0), "via": 2}}, 0.0)
    waiting = ("allgather check on world", 8.0)
    reports = {0: report(0, 300, 9, waiting_in=waiting), 1: {**report(1, 300, 9, waiting_in=waiting), "via": 0},
               2: {**report(2, 0, 0.4), "via": 2}}  # fmt: skip
    found = watchdog.look(reports, 9.0)
    assert [(f.kind, f.rank) for f in found] == [("hang", 2)], found
    assert found[0].detail.endswith("; ranks [3] report through it and are unseen since"), found[0].detail


def test_a_rank_stuck_in_an_await_whose_reports_still_come_through_its_waiting_leader_is_named():
    """Rank 1 awaits forever, its event loop running: its reports arrive an interval late through rank 0, its node
    leader, which waits in the collective. Reports that still come are no silence, so rank 1 is named itself."""
    watchdog = Watchdog(WatchdogSettings(hang_after_s=10), report_interval_s=1.0)
    watchdog.look({0: report(0, 1, 0), 1: {**report(1, 1, 0), "via": 0}}, 0.0)
    reports = {0: report(0, 1, 12, waiting_in=("allreduce on world", 11.0)), 1: {**report(1, 1, 11), "via": 0}}
    found = watchdog.look(reports, 12.0)
    assert [(f.kind, f.rank) for f in found] == [("hang", 1)], found


def test_a_straggler_is_the_rank_the_others_wait_for_report_after_report():
    watchdog = Watchdog(WatchdogSettings(straggler_intervals=3))
    found = []
    for interval in range(5):
        t = 2.0 * interval
        reports = {0: report(0, interval, t, wait_s=0.8 * t), 1: report(1, interval, t, wait_s=0.7 * t),
                   2: report(2, interval, t, wait_s=0.05 * t)}  # fmt: skip
        found.append(watchdog.look(reports, t))
    assert [len(f) for f in found] == [0, 0, 0, 1, 0]  # the third straggling interval in a row, and once
    assert found[3][0].kind == "straggler" and found[3][0].rank == 2 and "the others wait for it" in found[3][0].detail


def test_a_straggler_whose_reports_lag_is_still_the_one_named():
    """Rank 2 computes through three of rank 0's looks (its loop held, its report unchanged) while rank 0, starved of
    its core for a moment, waits less than rank 1: the suite saw rank 0 named, rank 2's last share left out."""
    watchdog = Watchdog(WatchdogSettings(straggler_intervals=3))
    found, slow_wait, late = [], 0.0, 0.0
    for look in range(9):
        t = 0.2 * look
        if look % 4 == 0:
            late = t  # rank 2's report reaches rank 0 every fourth look
        slow_wait += 0.2 * (0.3 if look % 4 else 0.8)
        reports = {0: report(0, look, t, wait_s=slow_wait), 1: report(1, look, t, wait_s=0.8 * t),
                   2: report(2, look, late, wait_s=0.01 * late)}  # fmt: skip
        found += watchdog.look(reports, t)
    assert [(f.kind, f.rank) for f in found] == [("straggler", 2)], found


def test_even_waiting_is_no_straggler():
    watchdog = Watchdog(WatchdogSettings(straggler_intervals=1))
    for interval in range(4):
        t = 2.0 * interval
        reports = {r: report(r, interval, t, wait_s=0.5 * t) for r in range(3)}
        assert watchdog.look(reports, t) == []


def _records(*beats: float, state: str = "running", declared: float | None = None) -> View:
    view = View()
    status = {"ranks": 2, "host": "h", "command": "memstore", "state": state}
    view.take({**record("status", "j", **status), "time": 0.0})
    said = {} if declared is None else {"interval_s": declared}
    for beat in beats:
        view.take({**record("heartbeat", "j", ranks_reporting=2, oldest_report_s=0.1, dropped=0, **said), "time": beat})
    return view


def test_watch_takes_a_job_for_dead_after_30_of_its_own_heartbeat_intervals():
    view = _records(1.0, 2.0, 3.0)
    assert view.interval_s == pytest.approx(1.0)
    assert not view.gone(3.0 + 29) and view.gone(3.0 + 31)
    fast = _records(1.0, 1.2, 1.4)  # 30 intervals of 0.2 s: 6 s, shorter than a loaded job's end; 15 s at least
    assert fast.interval_s == pytest.approx(0.2)
    assert not fast.gone(1.4 + 31 * 0.2) and not fast.gone(1.4 + GONE_AFTER_S - 0.1)
    assert fast.gone(1.4 + GONE_AFTER_S + 0.1)
    assert "NO HEARTBEAT for" in "\n".join(fast.lines())  # its time is long past
    assert fast.silent_s(2.0) == pytest.approx(0.6)


def test_heartbeats_that_come_together_do_not_shorten_the_interval_the_job_declared():
    """A busy loop's beat from the beat thread and the loop's own beat right after it (CI saw two 0.01 s apart):
    the watch took 0.01 s for the interval and the job for dead 0.3 s later, before its last will arrived."""
    view = _records(1.0, 1.01, declared=0.2)
    assert view.interval_s == pytest.approx(0.2)
    assert not view.gone(1.01 + 0.3) and not view.gone(1.01 + 29 * 0.2)
    slower = _records(1.0, 1.5, 2.0, declared=0.2)  # a loaded job beating slower than it said: its own pace counts
    assert slower.interval_s == pytest.approx(0.5)
    assert not problems(slower.latest["heartbeat"])
    assert problems({**slower.latest["heartbeat"], "interval_s": "0.2"}) == ["heartbeat: interval_s is '0.2'"]


def test_watch_waits_for_a_lost_job_and_never_calls_an_ended_one_dead():
    lost = _records(1.0, 1.2, state="lost")
    assert not lost.ended and not lost.gone(3.0)
    assert "watching for it to come back" in "\n".join(lost.lines())
    finished = _records(1.0, 1.2, state="finished")
    assert finished.ended and not finished.gone(10**9) and finished.silent_s(10**9) is None


def test_the_hang_threshold_grows_with_the_pace_of_a_loaded_job():
    """Steps of 0.5 s (a loaded node): a rank still for 3 s is slow, not stuck, though hang_after_s is 2; still for
    PATIENCE_STEPS of that pace (5 s) and more, it is named. Its first advance (start-up) sets no pace."""
    watchdog = Watchdog(WatchdogSettings(hang_after_s=2), report_interval_s=1.0)
    watchdog.look({0: report(0, 0, 0), 1: report(1, 0, 0)}, 0.0)
    watchdog.look({0: report(0, 1, 30), 1: report(1, 1, 30)}, 30.0)  # 30 s to the first step: start-up
    for now in (31.0, 32.0):  # then two steps a second, on both ranks
        step = int(1 + 2 * (now - 30))
        watchdog.look({0: report(0, step, now), 1: report(1, step, now)}, now)
    waiting = ("allreduce on world", 3.0)
    assert watchdog.look({0: report(0, 5, 35, waiting_in=waiting), 1: report(1, 5, 32)}, 35.0) == []
    found = watchdog.look({0: report(0, 5, 38, waiting_in=("allreduce on world", 6.0)), 1: report(1, 5, 32)}, 38.0)
    assert [(f.kind, f.rank) for f in found] == [("hang", 1)]


def test_per_node_reports_put_the_stalest_node_first_and_watch_names_a_silent_one():
    """Ranks 0-1 on node1 report now, ranks 2-3 on node2 last reported long ago (hung, or the node is gone): the
    metrics record's nodes put node2 first, and watch names it as silent while node1 is fresh. A job on one host
    shows no node lines."""
    now = time.time()
    reports = {r: {**report(r, 100 - r, now if r < 2 else now - 60), "host": f"node{r // 2 + 1}"} for r in range(4)}
    nodes = by_node(reports)
    assert nodes == [
        {"host": "node2", "ranks": [2, 3], "step": 97, "report_time": now - 60},
        {"host": "node1", "ranks": [0, 1], "step": 99, "report_time": now},
    ]
    metrics = record("metrics", "j", ranks_reporting=4, slowest_rank=3, values=spread(reports), nodes=nodes)
    assert problems(metrics) == []
    assert problems({**metrics, "nodes": [{"host": "node1"}]})  # a node without its fields is refused
    view = _records(now - 1.0, now - 0.5)
    view.take(metrics)
    shown = "\n".join(view.lines())
    assert "node node2 (ranks 2-3): step 97, SILENT for 60 s: its ranks are hung, or the node is gone" in shown
    assert "node node1 (ranks 0-1): step 99, reported" in shown and "node1 (ranks 0-1): step 99, SILENT" not in shown
    one_host = {r: report(r, 5, now) for r in range(2)}
    view.take(record("metrics", "j", ranks_reporting=2, slowest_rank=0, values=spread(one_host),
                     nodes=by_node(one_host)))  # fmt: skip
    assert " node " not in "\n".join(view.lines())


def test_a_finished_jobs_file_read_later_shows_its_nodes_as_they_were_when_it_ended():
    """A job that failed an hour ago, read from its file now: node1 had reported 0.4 s before the end, node2 (lost)
    60 s before it; the ages are measured to the job's end, so node1 is not called silent an hour on, and node2 is
    named silent for its 60 s."""
    end = time.time() - 3600
    reports = {r: {**report(r, 50, end - 0.4 if r < 2 else end - 60), "host": f"node{r // 2 + 1}"} for r in range(4)}
    view = _records(end - 1.0, end - 0.5)
    view.take({**record("metrics", "j", ranks_reporting=4, slowest_rank=2, values=spread(reports),
                        nodes=by_node(reports)), "time": end - 0.5})  # fmt: skip
    view.take({**record("status", "j", ranks=4, host="node1", command="dictlearn", state="failed"), "time": end})
    shown = "\n".join(view.lines())
    assert "node node1 (ranks 0-1): step 50, reported 0.4 s before the job ended" in shown, shown
    assert ("node node2 (ranks 2-3): step 50, SILENT for 60 s before the job ended: its ranks were hung, or the node "
            "was gone") in shown, shown  # fmt: skip
    assert "heartbeat 0.5 s before the job ended" in shown and " ago" not in shown, shown


def test_watch_says_how_many_of_the_jobs_ranks_report():
    """A node whose ranks have not reported yet shows in the count: 2 of the job's 4 ranks."""
    now = time.time()
    reports = {r: {**report(r, 5, now), "host": "node1"} for r in range(2)}
    view = View()
    view.take(record("status", "j", ranks=4, host="node1", command="dictlearn", state="running"))
    view.take(record("metrics", "j", ranks_reporting=2, slowest_rank=0, values=spread(reports), nodes=by_node(reports)))
    assert "slowest rank 0 (step 5; fastest at 5), 2 of 4 ranks reporting" in view.lines()


def test_watch_says_no_step_came_before_the_jobs_first_one():
    """Telemetry reports at once, before the job knows its steps: a job killed before its next report (a memory
    store at iteration 3,000 in its first interval) showed "0/0  0.0 steps/s ... ETA ?"."""
    view = View()
    view.take(record("status", "j", ranks=1, host="node1", command="memstore", state="running"))
    view.take(record("progress", "j", step=0, total=0, steps_per_s=0.0, eta_s=None, items_per_s=0.0))
    assert "no step reported yet" in view.lines() and not any("0/0" in line for line in view.lines())
    view.take(record("progress", "j", step=5, total=10, steps_per_s=1.0, eta_s=5.0, items_per_s=1.0))
    assert any(line.startswith("[###############...............] 5/10") for line in view.lines()), view.lines()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_watch_in_a_terminal_goes_back_over_every_row_a_wrapped_line_took(monkeypatch):
    """A failure event 250 characters long on an 80-column terminal takes 4 rows: the next redraw moves up over the
    status line's 1 and those 4, so the view stays in place instead of creeping down the screen."""
    monkeypatch.setenv("COLUMNS", "80")
    view = View()
    view.take({**record("status", "j", ranks=2, host="h", command="memstore", state="running"), "time": time.time()})
    view.take(record("event", "j", event="hang", rank=1, detail="x" * 226))  # 250 characters with its prefix
    terminal = _Terminal()
    screen = Screen(terminal)
    screen.draw(view)
    assert [len(line) for line in terminal.getvalue().splitlines()] == [39, 250]
    view.take(record("event", "j", event="checkpoint", rank=0, detail="step 10 saved"))
    screen.draw(view)
    assert terminal.getvalue().count("\x1b[5F\x1b[J") == 1


def test_watch_of_a_file_that_is_no_telemetry_says_so_at_once(tmp_path, capsys):
    """A .npy (bytes that are not UTF-8) and a JSON line that is no record: one line and status 2, followed or not,
    instead of a UnicodeDecodeError or a wait for a status that never comes."""
    from mpiscale.cli import main

    np.save(tmp_path / "x.npy", np.arange(1000.0))
    (tmp_path / "bad.jsonl").write_text('{"kind": "status"}\n')
    assert main(["watch", "--file", str(tmp_path / "x.npy")]) == 2
    assert "x.npy holds no telemetry record, only " in capsys.readouterr().err
    assert main(["watch", "--file", str(tmp_path / "bad.jsonl"), "--no-follow"]) == 2
    assert "bad.jsonl holds no telemetry record, only 1 line of something else" in capsys.readouterr().err


def test_a_restart_reads_why_the_previous_run_failed_from_the_jobs_telemetry_file(tmp_path):
    """The run that failed may have lost its stderr with its node (Slurm's batch host): the restarted run finds its
    failure in the telemetry file, the last run's only, past a torn line, and nothing after a run that ended well."""
    path = tmp_path / "out.h5.telemetry.jsonl"
    runs = [
        record("status", "j", state="running", command="dictlearn", ranks=4, host="node1"),
        record("event", "j", event="failure", rank=0, detail="an older run's failure"),
        record("status", "j", state="running", command="dictlearn", ranks=4, host="node1"),
        record("event", "j", event="failure", rank=0, detail="node node1 (ranks 0, 1) was lost while the job ran"),
        record("status", "j", state="failed", command="dictlearn", ranks=4, host="node2"),
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in runs) + '{"kind": "heart')
    sink = FileSink(path)
    assert sink.previous_failure() == "node node1 (ranks 0, 1) was lost while the job ran (rank 0)"
    with open(path, "a") as file:
        file.write("\n" + json.dumps(runs[0]) + "\n" + json.dumps({**runs[-1], "state": "finished"}) + "\n")
    assert sink.previous_failure() is None
    assert FileSink(tmp_path / "none.jsonl").previous_failure() is None
