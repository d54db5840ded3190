"""Hangs and stragglers, seen by rank 0 in the ranks' reports.

A rank **hangs** when it has not advanced (its step unchanged) for
``hang_after_s`` while it is not itself waiting in a collective (it computes,
or its reports stopped because its event loop is stuck) and another rank has
been waiting in a collective for at least half that time: the others wait for
it. On a loaded node every step slows down, so the threshold grows with the
pace the reports show: a rank is given at least ``PATIENCE_STEPS`` of the
slowest rank's recent seconds per step (a rank's first advance, which holds its
start-up, is not a pace). A report saying its rank waits counts while it is fresh: younger than half
``hang_after_s`` or two and a half report intervals, whichever is longer (a
report travels up to an interval before rank 0 looks at it). A rank
**straggles** when, for ``straggler_intervals`` reports in a row,
the share of its time spent waiting in collectives (between its latest two
reports) is under
``straggler_ratio`` of the other ranks' median share while they wait at
least a fifth of theirs: everyone else waits for it, every step.

A rank's reports reach rank 0 through its node's first rank (``via``): when
that leader is stuck, its node's other ranks fall silent with it though they
only wait for it, so the leader alone is named, with the ranks behind it. A
rank whose first report had not yet passed its leader when the leader stuck is
behind it too: rank 0 knows every rank's leader from the start (``leaders``).
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field

#: Steps of the slowest rank's recent pace a rank may take before it counts as stuck, however short hang_after_s is.
PATIENCE_STEPS = 10


@dataclass(frozen=True)
class WatchdogSettings:
    hang_after_s: float = 600.0  # MPISCALE_HANG_AFTER_S
    action: str = "report"  # MPISCALE_HANG_ACTION: report, or abort (the launcher's restart or Slurm's requeue follows)
    straggler_intervals: int = 5  # MPISCALE_STRAGGLER_INTERVALS
    straggler_ratio: float = 0.5

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> WatchdogSettings:
        env = os.environ if environ is None else environ
        try:
            settings = cls(
                hang_after_s=float(env.get("MPISCALE_HANG_AFTER_S", "600")),
                action=env.get("MPISCALE_HANG_ACTION", "report"),
                straggler_intervals=int(env.get("MPISCALE_STRAGGLER_INTERVALS", "5")),
            )
        except ValueError as error:
            raise ValueError(f"hang detection settings: {error}") from None
        # not "<= 0": a NaN compares false with everything and would never report a hang
        if (
            settings.action not in ("report", "abort")
            or not settings.hang_after_s > 0
            or settings.straggler_intervals < 1
        ):
            raise ValueError(
                "MPISCALE_HANG_ACTION must be report or abort, MPISCALE_HANG_AFTER_S a number > 0 (inf: never) and "
                "MPISCALE_STRAGGLER_INTERVALS >= 1"
            )
        return settings


@dataclass(frozen=True)
class Finding:
    kind: str  # "hang" or "straggler"
    rank: int
    detail: str


@dataclass
class Watchdog:
    settings: WatchdogSettings
    report_interval_s: float = 2.0  # how often ranks report (MPISCALE_TELEMETRY_INTERVAL_S)
    leaders: tuple[int, ...] = ()  # rank -> the rank its reports go through (its node's first)
    _advanced: dict[int, tuple[int, float]] = field(default_factory=dict)  # rank -> (its step, since when)
    _pace: dict[int, float] = field(default_factory=dict)  # rank -> its seconds per step between its last reports
    _moved: set[int] = field(default_factory=set)  # ranks seen advancing once (their start-up behind them)
    _waited: dict[int, tuple[float, float]] = field(default_factory=dict)  # rank -> (report time, wait_s)
    _shares: dict[int, float] = field(default_factory=dict)  # rank -> its share of time waiting, between its reports
    _slow: dict[int, int] = field(default_factory=dict)  # rank -> straggling reports in a row
    _told: set[tuple[str, int]] = field(default_factory=set)

    def look(self, reports: dict[int, dict], now: float) -> list[Finding]:
        """What the latest reports show that was not shown before."""
        findings = self._hangs(reports, now) + self._stragglers(reports)
        fresh = [f for f in findings if (f.kind, f.rank) not in self._told]
        self._told.update((f.kind, f.rank) for f in fresh)
        return fresh

    def _hangs(self, reports: dict[int, dict], now: float) -> list[Finding]:
        for rank, report in reports.items():
            before = self._advanced.get(rank)
            if before is None or before[0] != report["step"]:
                at = min(report["time"], now)  # it advanced by then
                if before is not None and report["step"] > before[0]:
                    if rank in self._moved:
                        self._pace[rank] = (at - before[1]) / (report["step"] - before[0])
                    self._moved.add(rank)
                self._advanced[rank] = (report["step"], at)
        hang_after = max(self.settings.hang_after_s, PATIENCE_STEPS * max(self._pace.values(), default=0.0))
        waiters = {r: rep["waiting_in"] for r, rep in reports.items() if rep.get("waiting_in")}
        long_waiters = {r: w for r, w in waiters.items() if w[1] >= hang_after / 2}
        fresh_s = max(hang_after / 2, self._quiet_after_s)
        stuck = {}  # rank -> seconds without advancing, for the ranks others wait for
        for rank, report in reports.items():
            still = now - self._advanced[rank][1]
            waiting_itself = rank in waiters and now - report["time"] < fresh_s
            if still >= hang_after and not waiting_itself and any(r != rank for r in long_waiters):
                stuck[rank] = still
        behind = {r: lead for r in reports if (lead := self._silent_leader(reports, r, now, hang_after)) is not None}
        silent = {r for r, report in reports.items() if now - report["time"] >= self._quiet_after_s}
        behind |= {r: lead for r, lead in enumerate(self.leaders) if r not in reports and lead in silent}  # never seen
        found = []
        for rank in sorted(stuck.keys() - behind.keys()):
            report, others = reports[rank], sorted(r for r in long_waiters if r != rank)
            what, seconds = long_waiters[others[0]]
            unseen = sorted(r for r, leader in behind.items() if leader == rank)
            through = f"; ranks {unseen} report through it and are unseen since" if unseen else ""
            found.append(Finding("hang", rank, (
                f"rank {rank} (host {report.get('host')}, pid {report.get('pid')}) has not advanced for "
                f"{stuck[rank]:.0f} s (step {report['step']}, last report {now - report['time']:.0f} s ago), while "
                f"ranks {others} wait in collectives (rank {others[0]}: {what}, {seconds:.0f} s){through}"
            )))  # fmt: skip
        return found

    @property
    def _quiet_after_s(self) -> float:
        """How old a rank's latest report may be while its reports still come (one travels up to an interval)."""
        return 2.5 * self.report_interval_s

    def _silent_leader(self, reports: dict[int, dict], rank: int, now: float, hang_after: float) -> int | None:
        """The node leader ``rank`` reports through, if that leader fell silent when ``rank`` did (None: not so).

        Only a silent rank can be behind a silent leader: a rank whose reports still arrive (its event loop runs,
        in an ``await`` that never ends, say) is named itself, and so is a rank whose leader still reports. The
        leader forwards its node's latest reports on its own tick, up to an interval old (more on a loaded node),
        so a rank's last report comes some time before its leader's last. Only a rank already silent for
        ``hang_after`` when its leader fell silent showed a hang of its own; any later silence may be the leader's.
        """
        leader = reports[rank].get("via", rank)
        if leader == rank or leader not in reports:
            return None
        quiet_after = self._quiet_after_s
        if now - reports[rank]["time"] < quiet_after or now - reports[leader]["time"] < quiet_after:
            return None
        return leader if reports[leader]["time"] - reports[rank]["time"] < hang_after else None

    def _stragglers(self, reports: dict[int, dict]) -> list[Finding]:
        for rank, report in reports.items():
            before = self._waited.get(rank)
            if before is not None and report["time"] <= before[0]:
                continue
            self._waited[rank] = (report["time"], report.get("wait_s", 0.0))
            if before is not None:
                self._shares[rank] = (report.get("wait_s", 0.0) - before[1]) / (report["time"] - before[0])
        # a rank without a new report keeps its last share: it is often the straggler itself, its loop held by its
        # computation past a tick, and leaving it out named the rank that waits least of the rest; no rank is judged
        # before every rank has a share
        shares = {rank: self._shares[rank] for rank in reports if rank in self._shares}
        if len(shares) < max(2, len(reports)):
            return []
        slowest = min(shares, key=lambda rank: (shares[rank], rank))
        others = statistics.median(share for rank, share in shares.items() if rank != slowest)
        straggling = others >= 0.2 and shares[slowest] < self.settings.straggler_ratio * others
        for rank in list(self._slow):
            if rank != slowest or not straggling:
                self._slow[rank] = 0
        if not straggling:
            return []
        self._slow[slowest] = self._slow.get(slowest, 0) + 1
        if self._slow[slowest] < self.settings.straggler_intervals:
            return []
        return [Finding("straggler", slowest, (
            f"rank {slowest} waits {shares[slowest]:.0%} of its time in collectives, the others a median "
            f"{others:.0%}, for {self._slow[slowest]} reports in a row: the others wait for it"
        ))]  # fmt: skip
