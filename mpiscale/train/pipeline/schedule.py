"""Pipeline schedules compiled to one action list per stage, checked before any step runs.

A stage runs its list in order: ``Action(FORWARD, m)`` waits for micro-batch
``m``'s activation from the stage before (the first stage reads its input),
computes, and sends the output on; ``Action(BACKWARD, m)`` waits for the
gradient of that output from the stage after (the last stage starts from its
loss), computes, and sends the input's gradient back. Sends never wait. So a
set of lists either runs to its end or stops for good where some stage waits
for a message that its sender's list only produces later; :func:`check` plays
the lists against each other and refuses such a set (and any list that skips,
repeats or reorders work) when the schedule is built, never during a step.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import MpiscaleError

FORWARD, BACKWARD = "F", "B"
SCHEDULES = ("1f1b", "gpipe")


class ScheduleError(MpiscaleError, ValueError):
    """A schedule that would skip or repeat work, or wait forever."""


@dataclass(frozen=True, slots=True)
class Action:
    """One forward or backward pass of one micro-batch on one stage."""

    kind: str  # FORWARD or BACKWARD
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}"


def gpipe(stages: int, micro_batches: int) -> list[list[Action]]:
    """GPipe: every forward, then every backward (last micro-batch first). Holds all M activations per stage."""
    _check_sizes(stages, micro_batches)
    forwards = [Action(FORWARD, m) for m in range(micro_batches)]
    backwards = [Action(BACKWARD, m) for m in reversed(range(micro_batches))]
    return [forwards + backwards for _ in range(stages)]


def one_f_one_b(stages: int, micro_batches: int) -> list[list[Action]]:
    """1F1B: stage ``s`` runs ``S - s - 1`` forwards ahead, then alternates one forward and one backward, then
    drains its backwards. At most ``S - s`` activations are held per stage, whatever ``M``."""
    _check_sizes(stages, micro_batches)
    lists = []
    for stage in range(stages):
        warmup = min(stages - stage - 1, micro_batches)
        actions = [Action(FORWARD, m) for m in range(warmup)]
        for m in range(micro_batches - warmup):
            actions += [Action(FORWARD, warmup + m), Action(BACKWARD, m)]
        actions += [Action(BACKWARD, m) for m in range(micro_batches - warmup, micro_batches)]
        lists.append(actions)
    return lists


def build(name: str, stages: int, micro_batches: int) -> list[list[Action]]:
    """The checked action lists of schedule ``name`` (one of :data:`SCHEDULES`)."""
    builders = {"1f1b": one_f_one_b, "gpipe": gpipe}
    if name not in builders:
        raise ScheduleError(f"schedule must be one of {', '.join(SCHEDULES)}, got {name!r}")
    lists = builders[name](stages, micro_batches)
    check(lists, micro_batches)
    return lists


def _check_sizes(stages: int, micro_batches: int) -> None:
    if stages < 1 or micro_batches < 1:
        raise ScheduleError(f"a pipeline needs at least 1 stage and 1 micro-batch, got {stages} and {micro_batches}")


def check(lists: list[list[Action]], micro_batches: int) -> None:
    """Refuse ``lists`` (one per stage) unless each stage runs every micro-batch's forward once, then its
    backward once, and the stages together run to the end: a deadlock shows here as stages that can go no
    further, each named with the action it would wait in."""
    expected = {Action(kind, m) for kind in (FORWARD, BACKWARD) for m in range(micro_batches)}
    for stage, actions in enumerate(lists):
        if len(actions) != len(expected) or set(actions) != expected:
            raise ScheduleError(f"stage {stage} must run F and B of micro-batches 0..{micro_batches - 1} once each")
        seen: set[int] = set()
        for action in actions:
            if action.kind == FORWARD:
                seen.add(action.micro_batch)
            elif action.micro_batch not in seen:
                raise ScheduleError(f"stage {stage} runs {action} before F{action.micro_batch}")
    _simulate(lists)


def _simulate(lists: list[list[Action]]) -> None:
    """Run the lists as the stages would (sends never wait); raise when some stage waits forever."""
    last = len(lists) - 1
    done: list[set[Action]] = [set() for _ in lists]
    position = [0] * len(lists)
    progressed = True
    while progressed:
        progressed = False
        for stage, actions in enumerate(lists):
            while position[stage] < len(actions):
                action = actions[position[stage]]
                if action.kind == FORWARD:
                    needs = None if stage == 0 else (stage - 1, action)
                else:
                    needs = None if stage == last else (stage + 1, action)
                if needs is not None and needs[1] not in done[needs[0]]:
                    break
                done[stage].add(action)
                position[stage] += 1
                progressed = True
    stuck = [f"stage {s} at {actions[position[s]]}" for s, actions in enumerate(lists) if position[s] < len(actions)]
    if stuck:
        raise ScheduleError("the schedule would deadlock: " + ", ".join(stuck))
