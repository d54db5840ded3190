"""Which checkpoints are kept (the newest ``keep``, the bases of their deltas, the newest shared one); the rest go."""

from __future__ import annotations

import logging
import shutil

from ...ranks import Comm
from .files import Layout
from .manifest import read_manifest

log = logging.getLogger(__name__)


def retire(layout: Layout, comm: Comm, keep: int, step: int, node: int, node_leader: bool) -> None:
    """Delete checkpoints beyond the newest ``keep`` (keeping delta bases and the newest shared one)."""
    kept = None
    if comm.Get_rank() == 0:
        try:
            kept = _retire_shared(layout, keep, step)
        except OSError as error:
            log.warning("checkpoint retention in %s failed: %s", layout.shared, error)
    kept = comm.bcast(kept, 0)
    if kept is None or layout.local is None or not node_leader:
        return
    for entry in layout.node_dir(node).glob("step-*"):
        old = int(entry.name.split("-")[1])
        if old <= step and old not in kept:
            shutil.rmtree(entry, ignore_errors=True)


def _retire_shared(layout: Layout, keep: int, step: int) -> set[int]:
    steps = layout.committed_steps()
    manifests = {s: read_manifest(layout.manifest(s)) for s in steps}
    kept = set(steps[:keep])
    with_shared = [s for s, manifest in manifests.items() if manifest and "shared" in manifest["levels"]]
    kept.update(with_shared[:1])
    kept.update(m["base"] for s in list(kept) if (m := manifests[s]) and m["base"] is not None)
    for entry in layout.shared.glob("step-*"):
        old = int(entry.name.split("-")[1].split(".")[0])
        if old <= step and old not in kept and entry.suffix != ".json":
            entry.unlink(missing_ok=True)
    for old in steps:
        if old not in kept:
            layout.manifest(old).unlink(missing_ok=True)
    return kept
