"""``user_job.py``'s steps with a defect planted in rank 0's hang watch: its first look raises.

``telemetry_fault.py STEPS``: the job must end with the watch's traceback, not run on without its reports and
hang watch, unsaid.
"""

import runpy
import sys
from pathlib import Path

from mpiscale.telemetry import Watchdog


def _defective_look(self, reports, now):
    raise RuntimeError("a defect planted in the hang watch")


Watchdog.look = _defective_look
sys.argv = [str(Path(__file__).with_name("user_job.py")), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
