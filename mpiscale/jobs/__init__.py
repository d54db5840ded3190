"""What every job shares: settings from TOML and the command line, the agreed start, output locks, steering,
progress, and results written with the ranks' agreement."""

from .lifecycle import observed
from .outputs import check_outputs, close_checkpointer, lock_results, start_agreed, write_results
from .progress import ProgressLine, duration
from .registry import JOBS, JobEntry, job_of_results, jobs_table
from .settings import add_options, load_settings, option, option_fields, run_job
from .state import announce, restore_compatible, same_bits_everywhere, settings_meta, steer

__all__ = [
    "JOBS",
    "JobEntry",
    "ProgressLine",
    "announce",
    "add_options",
    "check_outputs",
    "close_checkpointer",
    "duration",
    "job_of_results",
    "jobs_table",
    "lock_results",
    "observed",
    "load_settings",
    "option",
    "option_fields",
    "restore_compatible",
    "run_job",
    "same_bits_everywhere",
    "settings_meta",
    "start_agreed",
    "steer",
    "write_results",
]
