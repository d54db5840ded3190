"""Every job's state saves and loads through one protocol (``jobs.Stateful``): arrays out, the same state back in."""

import numpy as np
import pytest
import torch

from mpiscale.dictlearn.history import METRICS, History
from mpiscale.dictlearn.update import DictionaryState
from mpiscale.jobs import load_state, state_arrays
from mpiscale.memstore.history import IterationHistory
from mpiscale.memstore.store import Aggregate
from mpiscale.train.curves import Curves
from mpiscale.train.model import build_mlp
from mpiscale.train.state import TrainingState


def equal_arrays(first: dict, second: dict) -> None:
    assert first.keys() == second.keys()
    for name, value in first.items():
        np.testing.assert_array_equal(second[name], value, err_msg=name)


def test_dictionary_learning_state_and_record_round_trip():
    rng = np.random.default_rng(0)
    state = DictionaryState(rng.normal(size=(4, 3)), rng.normal(size=(4, 4)), rng.normal(size=(4, 3)), np.arange(4))
    history = History.start(10, 4)
    for iteration in range(3):
        history.record(dict.fromkeys(METRICS, float(iteration)), np.arange(4) + iteration)
    saved = state_arrays(state, history)
    again, record = DictionaryState.start(np.zeros((4, 3))), History.start(10, 4)
    load_state(saved, again, record)
    equal_arrays(saved, state_arrays(again, record))
    assert record.iterations == 3
    with pytest.raises(ValueError, match="the saved dictionary is of shape \\(4, 3\\), the job needs \\(5, 3\\)"):
        DictionaryState.start(np.zeros((5, 3))).from_arrays(saved)


def test_training_state_and_curves_round_trip_into_a_fresh_model():
    spec = {"inputs": 5, "hidden": [6], "classes": 3}
    torch.manual_seed(0)
    model = build_mlp(spec)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(8, 5)).sum().backward()
        optimizer.step()
    curves = Curves()
    curves.record_step(loss=1.0, accuracy=0.5, time_s=0.1, comm_wait_s=0.0)
    curves.record_epoch(epoch=1, validation_loss=0.9, validation_accuracy=0.6)
    saved = state_arrays(TrainingState(model, optimizer, "test"), curves)
    fresh = build_mlp(spec)
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.5)
    fresh_curves = Curves()
    load_state(saved, TrainingState(fresh, fresh_optimizer, "test"), fresh_curves)
    equal_arrays(saved, state_arrays(TrainingState(fresh, fresh_optimizer, "test"), fresh_curves))
    assert fresh_optimizer.param_groups[0]["lr"] == 0.01


def aggregate(seed: int) -> Aggregate:
    rng = np.random.default_rng(seed)
    return Aggregate(count=10 + seed, total=2.5 * seed, mean=0.25 * seed, maximum=0.9, histogram=rng.integers(0, 5, 4),
                     edges=np.linspace(0, 1, 5), top_ids=rng.integers(0, 99, 3), top_quality=rng.random(3))  # fmt: skip


def test_memory_store_history_round_trips_and_grows_from_commit_notes():
    history = IterationHistory()
    for seed in range(3):
        history.append(aggregate(seed), 0.01 * seed)
    saved = history.to_arrays()
    again = IterationHistory()
    again.from_arrays(history.to_arrays(slice(0, 2)))  # a checkpoint after iteration 2
    again.extend(history.to_arrays(slice(-1, None)))  # the note of commit 3, replayed
    equal_arrays(saved, again.to_arrays())
    again.from_arrays({})  # a checkpoint taken before the first iteration holds no rows
    assert len(again) == 0


def test_parts_that_name_the_same_array_are_refused():
    curves = Curves()
    with pytest.raises(
        ValueError, match="Curves names arrays another part of the state names: \\['curves.epoch.epoch'"
    ):
        state_arrays(curves, curves)


def test_the_progress_rate_leaves_out_the_first_step(monkeypatch):
    """The first step holds start-up (compilation): its time must not make the ETA hours long."""
    import io

    from mpiscale.jobs import ProgressLine
    from mpiscale.jobs import progress as progress_module

    clock = iter([0.0, 100.0, 101.0, 102.0, 103.0])  # the first step takes 100 s, the others 1 s
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: next(clock))
    stream = io.StringIO()
    line = ProgressLine(total=10, start=0, every=1e-9, unit="signals", stream=stream)
    line.update(1, "loss 1", 50)
    line.update(2, "loss 0.5", 50)
    line.update(3, "loss 0.4", 50)
    first, second, third = stream.getvalue().splitlines()
    assert first.endswith("measuring") and "ETA" not in first
    assert second.endswith("50 signals/s  ETA 0:00:08") and third.endswith("50 signals/s  ETA 0:00:07")
    line.finish()
    assert stream.getvalue().splitlines()[-1].endswith("done in 0:01:43")
