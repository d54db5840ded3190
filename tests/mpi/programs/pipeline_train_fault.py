"""`mpiscale train ARGS...` in which rank RANK, in the forward pass of micro-batch 1 at step AT, SIGKILLs itself
(``kill``) or blocks its event loop for two minutes, as a stuck native call would (``hang``). It prints when (Unix
time), so that a test measures how soon the job ends after the fault, not after its start (slow on a loaded node).

Usage: pipeline_train_fault.py kill|hang RANK AT train-options...
"""

import os
import signal
import sys
import time

from mpiscale.cli import main
from mpiscale.train.pipeline import Pipeline

FAULT, RANK, AT = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
_forward = Pipeline._forward


def forward_with_fault(self, run, m, x):
    if self.system.rank == RANK and run.step == AT and m == 1:
        if FAULT == "kill":
            print(f"rank {RANK} kills itself at step {AT} at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        print(f"rank {RANK} blocks at step {AT} at {time.time():.3f}", flush=True)
        time.sleep(120)
    _forward(self, run, m, x)


Pipeline._forward = forward_with_fault
sys.exit(main(["train", *sys.argv[4:]]))
