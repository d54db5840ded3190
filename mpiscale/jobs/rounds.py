"""Jobs whose output file is written in rounds of rows and marked as it goes (encode, collect).

Each round writes the next ``batch_size`` rows of every rank. The file's
attributes mark the rows done (and what a resume checks); a resume drops what
followed the last mark. A mark takes two flushes, each a sync of the file,
which cost more than a small round, so a round is marked only where rank 0's
last mark is ``--mark-every`` seconds old (``MARK_EVERY_S`` by default; its
word travels in the round's own allgather, so that every rank marks the same
rounds), and always at a stop, at a failure every rank raised, and at the end:
a kill loses the rounds of the last interval at most, and the round in flight.
"""

from __future__ import annotations

import math
import time
from typing import Any, Protocol

from ..runtime import ActorSystem
from .lifecycle import OutputAsState
from .settings import option

MARK_EVERY_S = 0.25  # seconds between marks of the rows done, at most (rows after the last are written again)


def mark_every_option() -> float:
    """The ``--mark-every`` setting of a job that writes marked rounds (one help text for every job)."""
    return option(
        MARK_EVERY_S,
        "seconds between marks of the rows done, at most: a mark syncs the output twice, and a killed run resumes "
        "from the last one (raise it where a sync is slow, as on some parallel file systems; 0: every round)",
    )


def mark_every_problems(mark_every: float) -> list[str]:
    """What is wrong with a job's ``--mark-every`` (nothing: an empty list)."""
    if not 0 <= mark_every < math.inf:
        return [f"mark_every must be a number of seconds, 0 or more, got {mark_every}"]
    return []


class _Batched(Protocol):
    @property
    def batch_size(self) -> int: ...

    @property
    def mark_every(self) -> float: ...


class MarkedRounds(OutputAsState):
    """``OutputAsState`` for a job that writes rounds of ``config.batch_size`` rows a rank: it calls
    ``rounds_written`` after each round, and ``mark`` where a failure every rank raised ends the rounds and in
    ``finish`` before the file is closed; a save (a stop) marks what was written."""

    system: ActorSystem
    config: _Batched
    _marks: dict[str, Any] = {}  # what the next mark writes (replaced, never changed in place)
    _marked: dict[str, Any] = {}  # what the last mark wrote
    _marked_at = -math.inf  # when (time.monotonic): the first round is marked

    @property
    def round_rows(self) -> int:
        """Rows one round writes, over all ranks."""
        return self.config.batch_size * self.system.size

    def mark_due(self) -> bool:
        """Whether this rank's last mark is ``config.mark_every`` seconds old: rank 0's answer, gathered in the
        round, decides."""
        return time.monotonic() - self._marked_at >= self.config.mark_every

    def rounds_written(self, due: bool, **marks: Any) -> None:
        """The rounds written so far come to ``marks`` (the same on every rank); marked now where ``due``
        (collective)."""
        self._marks = marks
        if due:
            self.mark()

    def mark(self) -> None:
        """The rows written so far marked done, after they reach the disk; nothing where no round came since the
        last mark (collective)."""
        if self._marks == self._marked:
            return
        writer = self._writer
        writer.flush()
        writer.mark(**self._marks)
        writer.flush()
        self._marked, self._marked_at = self._marks, time.monotonic()

    def save(self, done: int) -> None:
        self.mark()  # a stop: every round written is marked
