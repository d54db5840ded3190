"""A rank's view of the other processes of its host: a process that ended is gone, also before it is reaped."""

import os
import signal
import subprocess
import sys

from mpiscale.runtime.death_watch import alive
from mpiscale.runtime.peers import LocalPeers


def test_a_killed_child_is_gone_before_and_after_it_is_reaped():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        peers = LocalPeers({1: child.pid, 2: os.getpid()})
        assert alive(child.pid) and peers.gone() == {}
        child.send_signal(signal.SIGKILL)
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # ended, not yet reaped: a zombie
        assert not alive(child.pid) and peers.gone() == {1: child.pid}
    finally:
        child.kill()
        child.wait()
    assert peers.gone() == {1: child.pid}
