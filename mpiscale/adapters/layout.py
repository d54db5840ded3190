"""The compressed file's format names and where its groups live (shared by the job that writes it and its readers)."""

from __future__ import annotations

#: What ``compress-adapters`` writes: version 2 adds each group's update norms (``norm``) and each side's whole sum
#: of squares (``total``), which a resumed or joining run needs, and ``adapters/error_bound``.
ADAPTERS_FORMAT = "mpiscale.adapters/2"
#: What ``inspect`` and ``export`` read.
READABLE_FORMATS = ("mpiscale.adapters/1", ADAPTERS_FORMAT)


def group_name(index: int) -> str:
    """Where group ``index`` lives in the file."""
    return f"groups/{index:04d}"
