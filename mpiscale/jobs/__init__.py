"""What every job (dictlearn, train, collect) shares: settings from TOML and the command line, the progress line."""

from .outputs import check_outputs, close_checkpointer, lock_results, start_agreed
from .progress import ProgressLine, duration
from .settings import add_options, load_settings, option, option_fields, run_job
from .state import restore_compatible, same_bits_everywhere

__all__ = [
    "ProgressLine",
    "add_options",
    "check_outputs",
    "close_checkpointer",
    "duration",
    "lock_results",
    "load_settings",
    "option",
    "option_fields",
    "restore_compatible",
    "run_job",
    "same_bits_everywhere",
    "start_agreed",
]
