"""The decision behind the report of a collective some rank will never enter (a pure function of the ranks' answers)."""

import sys

from mpiscale.runtime.abandoned import CollectiveLog, diagnose
from mpiscale.runtime.blocking import _members_named


def _state(main="running", started=0, pending=None, last=None):
    return {"main": main, "host": "n1", "logs": {"world": {"started": started, "last": last, "pending": pending or {}}}}


def _waiting_in(operation: str, number: int) -> CollectiveLog:
    log = CollectiveLog("world", (0, 1, 2))
    for _ in range(number - 1):
        log.end(log.begin("barrier"))
    assert log.begin(operation) == number
    return log


def test_a_rank_that_left_main_before_the_collective_is_named():
    log = _waiting_in("allreduce", 3)
    states = {
        1: _state(pending={3: ("allreduce", "job.py:9", 4.0)}),
        2: _state("returned", 2, last=("barrier", 2, "job.py:7")),
    }
    report, reporter = diagnose(0, "n0", log, states)
    assert report.startswith(
        "a collective that not every rank will enter: allreduce #3 on world (ranks 0, 1 wait in it; rank 2 never will)"
    )
    assert (
        "rank 2 (host n1): left main (returned) after 2 collectives on world; the last: barrier #2, called at job.py:7"
        in report
    )
    assert "rank 1 (host n1): waits in allreduce #3 on world for 4.0 s, called at job.py:9" in report
    assert reporter == 0


def test_a_rank_that_left_after_entering_it_is_not_a_culprit():
    # rank 2 was the root of a broadcast it already finished: the wait is someone else's
    log = _waiting_in("bcast", 3)
    assert diagnose(0, "n0", log, {1: _state(), 2: _state("returned", 3)}) is None


def test_a_rank_that_passed_the_collective_and_waits_elsewhere_for_this_one_is_not_a_culprit():
    """Rank 1 came to blocking call #1 as rank 0 asked, completed it and went on to the next collective, on another
    communicator that rank 0 has not entered: rank 0's wait has ended, unseen yet. Counted as waiting for rank 0, rank
    1 was named as never coming and the job ended (a held check falling due as the late rank came)."""
    log = CollectiveLog("world (blocking calls)", (0, 1))
    log.begin("agree")
    awaited = CollectiveLog("world", (0, 1))
    awaited.end(awaited.begin("barrier"))
    passed = {"main": "running", "host": "n1", "logs": {
        "world (blocking calls)": {"started": 1, "last": ("agree", 1, "job.py:7"), "pending": {}, "members": [0, 1]},
        "world": {"started": 2, "last": None, "pending": {2: ("barrier", "job.py:9", 0.0)}, "members": [0, 1]},
        "a copy (blocking calls)": {"started": 1, "last": None, "pending": {1: ("agree", "job.py:8", 0.0)},
                                    "members": [0, 1]},
    }}  # fmt: skip
    assert diagnose(0, "n0", log, {1: passed}, {"world": awaited, log.name: log}) is None
    waiting = passed | {
        "logs": passed["logs"]
        | {"world (blocking calls)": {"started": 0, "last": None, "pending": {}, "members": [0, 1]}}
    }
    report, reporter = diagnose(0, "n0", log, {1: waiting}, {"world": awaited, log.name: log})
    assert "(rank 0 waits in it; rank 1 never will)" in report and reporter == 0


def test_late_busy_or_silent_ranks_prove_nothing():
    log = _waiting_in("allreduce", 3)
    assert diagnose(1, "n0", log, {0: _state(started=2), 2: None}) is None


def test_another_operation_at_the_same_position_is_named_and_the_lowest_stuck_rank_reports():
    log = _waiting_in("allreduce", 2)
    states = {0: _state(started=2, pending={2: ("barrier", "job.py:5", 1.0)}), 1: _state("returned", 2)}
    report, reporter = diagnose(2, "n0", log, states)
    assert "(rank 2 waits in it; rank 0 never will)" in report
    assert "rank 0 (host n1): waits in barrier #2 on world" in report
    assert reporter == 0


def test_a_call_refused_before_mpi_does_not_count():
    log = CollectiveLog("world", (0, 1))
    log.end(log.begin("allreduce"))
    log.cancel(log.begin("allreduce"))  # e.g. an object array, refused on this rank only
    assert log.started == 1 and not log.pending and log.oldest() is None


def test_each_call_is_logged_at_the_line_that_made_it_however_often_it_runs():
    log = CollectiveLog("world", (0, 1))
    for _ in range(3):  # a site is found once and then recalled: the same line gives the same site, others their own
        first = log.begin("allreduce"), sys._getframe().f_lineno
        second = log.begin("allreduce"), sys._getframe().f_lineno
        assert log.pending[first[0]][1] == f"test_abandoned_collectives.py:{first[1]}"
        assert log.pending[second[0]][1] == f"test_abandoned_collectives.py:{second[1]}"


def test_functions_made_and_dropped_one_after_another_each_get_their_own_sites():
    """A site is recalled by its code object's id: one that is dropped keeps its entry (and so its id) from a new
    function's code, which would otherwise be taken for it."""
    log = CollectiveLog("world", (0, 1))
    for padding in range(1, 40):
        scope: dict = {}
        exec(compile("\n" * padding + "def job(log):\n    return log.begin('barrier')\n", "job.py", "exec"), scope)
        number = scope.pop("job")(log)
        assert log.pending[number][1] == f"job.py:{padding + 2}"


def test_a_communicator_of_some_ranks_is_named_by_its_members_briefly():
    """Logs of blocking calls are matched by name: the members tell two unnamed communicators apart, and a stride
    over many ranks is named by its count, ends and a digest rather than by every rank."""
    assert _members_named((0, 2)) == "ranks 0, 2"
    assert _members_named(tuple(range(64))) == "ranks 0-63"
    strided = _members_named(tuple(range(0, 1000, 8)))
    assert strided.startswith("125 ranks 0 to 992 #") and len(strided) < 40
    assert strided != _members_named((*range(0, 984, 8), 989, 992))  # the same count and ends, other members
