"""The last stage's loss of a step: every micro-batch's loss read once the step is done (a stage on a GPU would
otherwise wait for its device after each forward), summed exactly as one float at a time would be."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpiscale.train.pipeline.stages import sum_in_order


def test_the_losses_add_in_order_as_python_floats():
    rng = np.random.default_rng(3)
    values = (rng.standard_normal(33) * 10.0 ** rng.integers(-6, 6, 33)).astype(np.float32)
    losses = [torch.tensor(v) for v in values]
    expected = 0.0
    for loss in losses:
        expected += float(loss)
    assert sum_in_order(losses) == expected  # the same bits as a float added per micro-batch
    assert sum_in_order([]) == 0.0


def test_one_number_losses_of_other_shapes_and_dtypes_count_and_anything_more_is_refused():
    mixed = [torch.tensor(1.5), torch.tensor([2.25]), torch.tensor([[0.125]], dtype=torch.float64)]
    assert sum_in_order(mixed) == 3.875
    with pytest.raises(ValueError, match=r"must be one number, got shapes \[\(\), \(2,\)\]"):
        sum_in_order([torch.tensor(1.0), torch.tensor([1.0, 2.0])])
