"""Running a job from the command line: its settings loaded, then the job on every rank under the runtime."""

from __future__ import annotations

import argparse

from ..jobs import observed, run_job
from ..runtime import run


def run_job_command(args: argparse.Namespace) -> int:
    """A job command: its settings from the defaults, --config and the options, then the job on every rank.

    The job's module is imported only now (train's imports torch), from its registry entry.
    """
    entry = args.job_entry
    job = entry.load("entry")

    def under_telemetry(config):
        out = getattr(config, "out", None)
        return run(lambda system: observed(system, entry.name, out, lambda: job(system, config), entry.steers))

    return run_job(entry.name, entry.load("settings"), args, under_telemetry)
