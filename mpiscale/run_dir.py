"""What a rank tells ``launch/mpiscale-run`` through the folder it names in ``MPISCALE_RUN_DIR``.

A rank writes ``held.PID`` once it holds stop signals (``mpiscale.early_stop``): the launcher passes a stop on
only then, since before it the signal's default action would kill the rank without a word. It writes
``status.PID`` with the status it exits with: when Slurm's cancel signals every process of a job, mpirun too,
mpirun exits with 1 whatever its ranks did, and the launcher takes the ranks' own status instead. Nothing is
written outside such a launcher. Imported while a rank starts: standard library only.
"""

from __future__ import annotations

import contextlib
import os

VARIABLE = "MPISCALE_RUN_DIR"


def note(name: str, text: str = "") -> None:
    """Write ``text`` to ``NAME.PID`` in the launcher's run folder, if there is one (errors ignored: a note; the
    launcher counts the notes, one per rank)."""
    folder = os.environ.get(VARIABLE)
    if not folder:
        return
    with contextlib.suppress(OSError), open(os.path.join(folder, f"{name}.{os.getpid()}"), "w") as out:
        out.write(text)
