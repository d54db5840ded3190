"""Cutting an ``nn.Sequential`` into pipeline stages: balanced by parameter count, or where the user says.

Stages are contiguous runs of the sequence's children, each an ``nn.Sequential``
that keeps its children's names, so a stage's ``state_dict`` keys are the
whole model's keys (``hidden3.weight`` stays ``hidden3.weight``) and
parameters can be saved and restored by name whatever the number of stages.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from ...ranks import balanced_starts


def split_sequential(
    model: torch.nn.Sequential, stages: int, points: Sequence[str | int] | None = None
) -> list[torch.nn.Sequential]:
    """``model`` cut into ``stages`` consecutive parts.

    ``points``: where stages 1.. begin, as child names or indices (``stages - 1`` of them, increasing); by
    default the cuts balance the parameter count (the largest stage as small as it can be).
    """
    if not isinstance(model, torch.nn.Sequential):
        raise TypeError(f"split_sequential takes an nn.Sequential, got {type(model).__name__}")
    children = list(model.named_children())
    if not 1 <= stages <= len(children):
        raise ValueError(f"cannot cut a sequence of {len(children)} modules into {stages} stages")
    if points is None:
        starts = balanced_starts([_parameters(module) for _, module in children], stages)
    else:
        starts = [0, *_starts_of(points, [name for name, _ in children], stages)]
    bounds = [*starts, len(children)]
    return [torch.nn.Sequential(OrderedDict(children[bounds[i] : bounds[i + 1]])) for i in range(stages)]


def _parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _starts_of(points: Sequence[str | int], names: list[str], stages: int) -> list[int]:
    if len(points) != stages - 1:
        raise ValueError(f"{stages} stages need {stages - 1} split points, got {len(points)}: {list(points)}")
    starts = []
    for point in points:
        if isinstance(point, str):
            if point not in names:
                raise ValueError(f"split point {point!r} is not a module of the model ({', '.join(names)})")
            starts.append(names.index(point))
        else:
            starts.append(int(point))
    if not all(a < b for a, b in zip([0, *starts], [*starts, len(names)])):
        raise ValueError(f"split points must increase within 1..{len(names) - 1} and leave no stage empty: {points}")
    return starts
