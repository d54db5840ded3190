"""Pipeline schedules and model splits, on one process: what each stage runs, and what is refused at build time."""

import pytest
import torch

from mpiscale.ranks import balanced_starts
from mpiscale.train.pipeline import Action, ScheduleError, build, split_sequential
from mpiscale.train.pipeline.schedule import BACKWARD, FORWARD, check


def text(actions: list[Action]) -> str:
    return " ".join(map(str, actions))


def test_1f1b_warms_up_then_alternates_then_drains():
    lists = build("1f1b", 3, 5)
    assert text(lists[0]) == "F0 F1 F2 B0 F3 B1 F4 B2 B3 B4"
    assert text(lists[1]) == "F0 F1 B0 F2 B1 F3 B2 F4 B3 B4"
    assert text(lists[2]) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4"


def test_gpipe_runs_every_forward_then_every_backward():
    assert all(text(actions) == "F0 F1 F2 B2 B1 B0" for actions in build("gpipe", 4, 3))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("micro_batches", [1, 2, 3, 8, 33])
def test_every_schedule_builds_and_holds_what_it_promises(schedule, stages, micro_batches):
    """Fewer micro-batches than stages included; 1F1B holds at most S - s activations on stage s."""
    for stage, actions in enumerate(build(schedule, stages, micro_batches)):
        in_flight = peak = 0
        for action in actions:
            in_flight += 1 if action.kind == FORWARD else -1
            peak = max(peak, in_flight)
        limit = min(stages - stage, micro_batches) if schedule == "1f1b" else micro_batches
        assert peak == limit


def test_a_schedule_that_would_deadlock_is_refused_naming_the_stuck_stages():
    # stage 1 wants B0's gradient before it has sent F1 on; stage 2 (the last) wants F1 before it can send B0
    lists = [
        [Action(FORWARD, 0), Action(FORWARD, 1), Action(BACKWARD, 0), Action(BACKWARD, 1)],
        [Action(FORWARD, 0), Action(BACKWARD, 0), Action(FORWARD, 1), Action(BACKWARD, 1)],
        [Action(FORWARD, 0), Action(FORWARD, 1), Action(BACKWARD, 0), Action(BACKWARD, 1)],
    ]
    with pytest.raises(ScheduleError, match="deadlock: stage 0 at B0, stage 1 at B0, stage 2 at F1"):
        check(lists, 2)


def test_lists_that_skip_repeat_or_reorder_work_are_refused():
    with pytest.raises(ScheduleError, match="stage 0 must run F and B of micro-batches 0..1 once each"):
        check([[Action(FORWARD, 0), Action(BACKWARD, 0), Action(FORWARD, 1), Action(FORWARD, 1)]], 2)
    with pytest.raises(ScheduleError, match="stage 0 runs B0 before F0"):
        check([[Action(BACKWARD, 0), Action(FORWARD, 0)]], 1)
    with pytest.raises(ScheduleError, match="schedule must be one of 1f1b, gpipe"):
        build("zigzag", 2, 4)
    with pytest.raises(ScheduleError, match="at least 1 stage and 1 micro-batch"):
        build("1f1b", 2, 0)


def test_balanced_cuts_make_the_heaviest_stage_as_light_as_possible():
    assert balanced_starts([10, 10, 10, 10], 2) == [0, 2]
    assert balanced_starts([1, 1, 1, 1], 4) == [0, 1, 2, 3]
    assert balanced_starts([5, 1, 1, 1, 1, 1], 2) == [0, 1]  # 5 | 5, not 7 | 3
    weights = [3, 9, 1, 4, 4, 8, 2, 2, 6]
    starts = balanced_starts(weights, 3)
    parts = [sum(weights[a:b]) for a, b in zip(starts, [*starts[1:], len(weights)])]
    best = min(
        max(sum(weights[:i]), sum(weights[i:j]), sum(weights[j:]))
        for i in range(1, len(weights))
        for j in range(i + 1, len(weights))
    )
    assert max(parts) == best


def model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers = [("hidden1", torch.nn.Linear(4, 64)), ("relu1", torch.nn.ReLU()), ("hidden2", torch.nn.Linear(64, 8)),
              ("relu2", torch.nn.ReLU()), ("output", torch.nn.Linear(8, 2))]  # fmt: skip
    from collections import OrderedDict

    return torch.nn.Sequential(OrderedDict(layers))


def test_split_stages_keep_the_names_and_compute_what_the_whole_model_does():
    whole = model()
    stages = split_sequential(whole, 2)
    names = [key for stage in stages for key in stage.state_dict()]
    assert names == list(whole.state_dict())
    assert list(stages[0].state_dict()) == ["hidden1.weight", "hidden1.bias"]  # 320 of 930 parameters, then 610
    x = torch.randn(5, 4)
    assert torch.equal(stages[1](stages[0](x)), whole(x))


def test_split_points_by_name_or_index_and_their_refusals():
    assert [list(dict(s.named_children())) for s in split_sequential(model(), 3, ["hidden2", 4])] == [
        ["hidden1", "relu1"], ["hidden2", "relu2"], ["output"]]  # fmt: skip
    with pytest.raises(ValueError, match="'hidden9' is not a module of the model"):
        split_sequential(model(), 2, ["hidden9"])
    with pytest.raises(ValueError, match="3 stages need 2 split points, got 1"):
        split_sequential(model(), 3, ["relu1"])
    with pytest.raises(ValueError, match="must increase"):
        split_sequential(model(), 3, [3, 2])
    with pytest.raises(ValueError, match="cannot cut a sequence of 5 modules into 6 stages"):
        split_sequential(model(), 6)
    with pytest.raises(TypeError, match="takes an nn.Sequential"):
        split_sequential(torch.nn.Linear(2, 2), 1)  # type: ignore[arg-type]
