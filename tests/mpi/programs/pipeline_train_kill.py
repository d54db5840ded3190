"""`mpiscale train ARGS...` in which rank KILLED SIGKILLs itself in the forward pass of micro-batch 1 at step AT.

Usage: pipeline_train_kill.py KILLED AT train-options...
"""

import os
import signal
import sys

from mpiscale.cli import main
from mpiscale.train.pipeline import Pipeline

KILLED, AT = int(sys.argv[1]), int(sys.argv[2])
_forward = Pipeline._forward


async def forward_or_die(self, run, m):
    if self.system.rank == KILLED and run.step == AT and m == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    await _forward(self, run, m)


Pipeline._forward = forward_or_die
sys.exit(main(["train", *sys.argv[3:]]))
