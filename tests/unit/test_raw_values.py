"""What a channel carries for the workloads: graph values as parts and back, pipeline tensors as arrays and back."""

import numpy as np
import pytest
import torch

from mpiscale.circuits.edges import Assembler, as_parts
from mpiscale.circuits.graph import Failed
from mpiscale.train.tensor_channel import channel_array, channel_tensor


def _round_trip(value):
    parts = as_parts(value)
    assert parts is not None
    got = []
    assembler = Assembler(lambda source, lane, batch, value: got.append((source, lane, batch, value)))
    for index, part in enumerate(parts):
        assert part.flags.c_contiguous
        assembler.part(1, 4, (7, index, len(parts)), part.copy())  # a copy: what a receiver's buffer holds
    assert [entry[:3] for entry in got] == [(1, 4, 7)]
    return got[0][3]


def test_an_array_is_one_part_and_comes_back_as_it_was():
    value = np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2]  # not contiguous: made so for the wire
    back = _round_trip(value)
    assert back.dtype == value.dtype and np.array_equal(back, value)


def test_a_models_layer_outputs_come_back_with_their_names_in_order():
    value = {"": np.ones((2, 3), np.float32), "block.1": np.arange(4, dtype=np.float64), "ü": np.zeros(0, np.int8)}
    back = _round_trip(value)
    assert list(back) == list(value)
    for name in value:
        assert back[name].dtype == value[name].dtype and np.array_equal(back[name], value[name])


@pytest.mark.parametrize(
    "value",
    [
        Failed("node 'x' on batch 3: ValueError: no"),
        np.array([object()]),
        {},
        {"a": np.ones(2), "b": [1, 2]},
        {"a\0b": np.ones(2)},
        np.zeros((1,) * 8),
    ],
)
def test_what_is_not_plain_arrays_travels_otherwise(value):
    assert as_parts(value) is None


def test_a_part_out_of_its_place_is_refused():
    assembler = Assembler(lambda *arrived: None)
    with pytest.raises(ValueError, match="graph value part 1 of 2 .batch 5. from rank 3 after 0 parts"):
        assembler.part(3, 0, (5, 1, 2), np.ones(2))


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.bool]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_tensor_travels_as_an_array_and_comes_back_with_its_dtype(dtype):
    tensor = (torch.arange(24).reshape(2, 3, 4) % 5).to(dtype)
    array, flags = channel_array(tensor.t() if tensor.ndim == 2 else tensor.transpose(0, 2))
    back = channel_tensor(array.copy(), flags)
    assert array.flags.c_contiguous and back.dtype == dtype and torch.equal(back, tensor.transpose(0, 2))


def test_an_output_in_autograd_travels_as_a_view_of_its_memory():
    """A stage's output requires a gradient; what travels is its memory, detached, without a copy."""
    out = torch.ones(4, 8, requires_grad=True) * 3
    array, flags = channel_array(out)
    assert flags == 0 and np.shares_memory(array, out.detach().numpy()) and (array == 3).all()


def test_what_cannot_travel_is_refused_naming_stage_micro_batch_and_what_it_was():
    from types import SimpleNamespace

    from mpiscale.train.pipeline.schedule import BACKWARD, FORWARD
    from mpiscale.train.pipeline.stages import Pipeline

    stage = SimpleNamespace(stage=1)
    with pytest.raises(TypeError, match="^pipeline stage 1: the output of micro-batch 2 is a tuple, not a tensor$"):
        Pipeline._send(stage, FORWARD, 0, 2, (torch.ones(2),), False)
    with pytest.raises(TypeError, match="^pipeline stage 1: the input gradient of micro-batch 3 is a tensor of "
                       "torch.complex32, which cannot travel"):  # fmt: skip
        Pipeline._send(stage, BACKWARD, 0, 3, torch.ones(2, dtype=torch.complex32), False)


def test_a_gradient_of_another_shape_than_its_output_is_refused_naming_stage_and_micro_batch():
    from types import SimpleNamespace

    from mpiscale.train.pipeline.stages import Pipeline

    stage = SimpleNamespace(stage=1)
    out = torch.ones(4, 8)
    Pipeline._check_gradient(stage, out, torch.zeros(4, 8), 3, 2)  # the output's shape and dtype: taken
    with pytest.raises(
        ValueError,
        match=r"pipeline stage 1: the gradient of micro-batch 2 \(step 3\) from stage 2 "
        r"is \(4, 9\) torch.float32, but its output was \(4, 8\) torch.float32",
    ):
        Pipeline._check_gradient(stage, out, torch.zeros(4, 9), 3, 2)
