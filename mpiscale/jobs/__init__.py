"""What every job shares: settings from TOML and the command line, the agreed start, output locks, steering,
progress, and results written with the ranks' agreement."""

from .device import DEVICES, SHARE_GPUS, choose_torch_device, gpu_for_rank, mpi_cuda_aware, recorded_devices
from .lifecycle import Ended, HeldOutputs, Plan, Step, SteppedJob, observed, run_lifecycle
from .outputs import (
    claim_outputs,
    close_checkpointer,
    give_back,
    run_without_steps,
    start_agreed,
    write_results,
)
from .progress import ProgressLine, duration
from .registry import JOBS, JobEntry, job_of_results, jobs_table, jobs_with
from .settings import add_options, load_settings, option, option_fields, run_job
from .state import (
    Stateful,
    announce,
    kept_name,
    load_state,
    restore_compatible,
    same_bits_everywhere,
    setting_differences,
    settings_meta,
    state_arrays,
    steer,
    stopped_at_start,
)

__all__ = [
    "DEVICES",
    "JOBS",
    "SHARE_GPUS",
    "choose_torch_device",
    "gpu_for_rank",
    "mpi_cuda_aware",
    "recorded_devices",
    "Ended",
    "HeldOutputs",
    "JobEntry",
    "ProgressLine",
    "announce",
    "add_options",
    "claim_outputs",
    "close_checkpointer",
    "duration",
    "give_back",
    "job_of_results",
    "jobs_table",
    "jobs_with",
    "kept_name",
    "observed",
    "load_settings",
    "load_state",
    "option",
    "option_fields",
    "Plan",
    "restore_compatible",
    "run_lifecycle",
    "run_job",
    "same_bits_everywhere",
    "setting_differences",
    "settings_meta",
    "run_without_steps",
    "start_agreed",
    "state_arrays",
    "Stateful",
    "Step",
    "SteppedJob",
    "steer",
    "stopped_at_start",
    "write_results",
]
