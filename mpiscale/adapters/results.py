"""The compressed file of ``mpiscale compress-adapters`` (``mpiscale.adapters/2``): its report and its plot.

Layout, all readable with plain h5py (strings are fixed-length UTF-8 bytes):

- ``/adapters/{name, path, sha256, config}``: one row per adapter (``config`` is its
  adapter_config.json), ``/adapters/error``: the relative error of its whole update, and
  ``/adapters/error_bound``: 1 where that error is an upper bound (an adapter that joined the file
  from an earlier compressed file, whose weights the job no longer had);
- ``/modules``: the layer groups' module names, in order; group i is ``/groups/NNNN`` (i in
  four digits) with, for each side S in A and B, ``S/components`` (k x in for A, k x out for
  B), ``S/loadings`` (adapters x r x k), ``S/explained`` (each component's share of the
  side's sum of squares) and ``S/total`` (that sum), ``norm`` (each adapter's update norm
  ||B A|| in this group) and ``error`` (its relative error in this group);
- attributes: the usual mpiscale ones, ``base_model``, ``target_modules`` (JSON), ``rank``,
  ``adapters``, ``groups_done``.

Version 1 files (no ``norm``, ``total``, ``error_bound``) are read too, but cannot be joined.

Adapter i's matrices of group g are ``A = loadings_A[i] @ components_A`` and
``B = (loadings_B[i] @ components_B).T``.
"""

from __future__ import annotations

import numpy as np

from ..io import open_file
from ..words import how_to_finish
from .layout import READABLE_FORMATS, group_name


def group_names(file) -> list[str]:
    """The module name of each group, in order."""
    return [name.decode() for name in file["modules"][()]]


def summarize(path: str) -> str:
    """Adapters, groups, components kept, how much of the parameters is stored, and the errors; of a stopped or
    killed run's file (``OUT.partial``, ``OUT.tmp``), the groups it completed and how to finish."""
    with open_file(path, READABLE_FORMATS) as file:
        modules = group_names(file)
        done = groups_done(file)
        names = [name.decode() for name in file["adapters/name"][()]]
        errors = file["adapters/error"][()]
        bounds = int(file["adapters/error_bound"][()].sum()) if "adapters/error_bound" in file else 0
        rank = int(file.attrs["rank"])
        kept, original, stored = [], 0, 0
        for index in range(done):
            group = file[group_name(index)]
            a, b = group["A/components"], group["B/components"]
            kept.append((a.shape[0], b.shape[0], group["A/explained"][()].sum(), group["B/explained"][()].sum()))
            original += len(names) * rank * (a.shape[1] + b.shape[1])
            stored += a.size + b.size + len(names) * rank * (a.shape[0] + b.shape[0])
        base = file.attrs["base_model"] or "(not named)"
        device = file.attrs.get("device", "cpu")  # files of before the device was recorded: the CPU's
    lines = [f"{path}: {len(names)} LoRA adapters of rank {rank} on base model {base}, {len(modules)} layer groups "
             f"(computed on {device})"]  # fmt: skip
    if done < len(modules):
        lines.append(f"layer groups: {done} of {len(modules)} done; {how_to_finish(path, 'compress-adapters', 'does')}")
    if kept:
        ks = np.array([k for k in kept for k in k[:2]])
        explained = np.array([share for k in kept for share in k[2:]])
        lines.append(f"components per group and side: {ks.min()}-{ks.max()} (median {np.median(ks):.0f}); they "
                     f"explain {explained.min():.2%}-{explained.max():.2%} of each side's sum of squares")  # fmt: skip
    if done < len(modules):
        return "\n".join(lines)  # (the adapters' errors are written at the end)
    worst = int(np.argmax(errors))
    return "\n".join([
        *lines,
        f"stored: {stored:,} of {original:,} parameters ({stored / max(original, 1):.1%})",
        f"relative error of an adapter's update: median {np.median(errors):.3g}, largest {errors[worst]:.3g} "
        f"({names[worst]})" + (f"; {bounds} of them are upper bounds (adapters that joined from an earlier file)"
                               if bounds else ""),
    ])  # fmt: skip


def groups_done(file) -> int:
    """The layer groups a file holds: all of them, but in a stopped or killed run's file."""
    return int(file.attrs.get("groups_done", len(file["modules"])))


def plot(path: str, image: str) -> None:
    """The cumulative explained share against the number of components (see ``figure``), saved to ``image``."""
    import matplotlib.pyplot as plt

    drawn = figure(path)
    drawn.savefig(image, dpi=120)
    plt.close(drawn)


LEGEND_GROUPS = 12  # groups named in the legend; more make it unreadable, and the rest are listed as a count


def figure(path: str):
    """The cumulative explained share against the number of components, one line per layer group and side, each
    group named in the legend (the first ``LEGEND_GROUPS``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    with open_file(path, READABLE_FORMATS) as file:
        names = group_names(file)
        for index, name in enumerate(names[: groups_done(file)]):
            for axis, side in zip(axes, ("A", "B"), strict=True):
                shares = np.cumsum(file[f"{group_name(index)}/{side}/explained"][()])
                label = name if index < LEGEND_GROUPS else None
                axis.plot(np.arange(1, len(shares) + 1), shares, alpha=0.6, label=label)
    for axis, side in zip(axes, ("A", "B"), strict=True):
        axis.set_title(f"LoRA {side} matrices")
        axis.set_xlabel(f"components ({side} side)")
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("share of the sum of squares explained")
    more = len(names) - LEGEND_GROUPS
    axes[1].legend(title="layer group" + (f" (and {more} more)" if more > 0 else ""), fontsize=7, loc="lower right")
    drawn.suptitle(f"{path}: explained share per layer group (one line each)")
    drawn.tight_layout()
    return drawn
