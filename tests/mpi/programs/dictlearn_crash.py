"""`mpiscale dictlearn ARGS...`, killed hard (SIGKILL of rank 1) once the checkpoint of iteration KILL_AT is committed.

Usage: dictlearn_crash.py KILL_AT dictlearn-options...
"""

import os
import signal
import sys
import time

from mpiscale.cli import main
from mpiscale.io import Checkpointer

KILL_AT = int(sys.argv[1])
_save = Checkpointer.save


def save_then_die(self, step, *args, **kwargs):
    _save(self, step, *args, **kwargs)
    if step == KILL_AT:
        self.wait()  # every rank's part written and the step committed
        self._front.Barrier()
        if self.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # mpirun ends the others once rank 1 is gone


Checkpointer.save = save_then_die
sys.exit(main(["dictlearn", *sys.argv[2:]]))
