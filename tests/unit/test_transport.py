"""Message encoding without MPI: frames, inline and separate parts."""

import numpy as np
import pytest
import torch

from mpiscale.runtime import transport


def roundtrip(obj, inline_bytes=65536):
    encoded = transport.encode(obj, seq=5, inline_bytes=inline_bytes)
    frame = memoryview(bytearray(encoded.frame))
    header = transport.decode_frame(frame)
    assert header.seq == 5
    if header.inline_parts is not None:
        assert encoded.parts == []
        return transport.deserialize(header.inline_parts), encoded
    received = [transport.allocate(n) for n in header.sizes]
    for source, target in zip(encoded.parts, received):
        target[:] = source
    return transport.deserialize(received), encoded


def test_small_message_is_one_inline_frame():
    value, encoded = roundtrip({"a": 1, "b": np.arange(3)})
    assert encoded.parts == [] and value["a"] == 1 and np.array_equal(value["b"], np.arange(3))


def test_arrays_travel_out_of_band_without_copies():
    array = np.random.default_rng(0).random((500, 300))
    parts = transport.serialize({"x": array})
    assert len(parts) == 2
    assert parts[1].nbytes == array.nbytes
    assert np.shares_memory(np.frombuffer(parts[1], dtype=np.uint8), array)  # zero copy on send
    value, encoded = roundtrip({"x": array})
    assert encoded.parts and np.array_equal(value["x"], array)


@pytest.mark.parametrize(
    "array",
    [
        np.asfortranarray(np.arange(12.0).reshape(3, 4)),
        np.arange(30)[::4],
        np.array(2.5),
        np.zeros((0, 3)),
        np.array([(1, 2.0)], dtype=[("a", "i4"), ("b", "f8")]),
        np.array(["x", None], dtype=object),
        np.arange(6, dtype=">i4"),
    ],
    ids=["fortran", "strided", "0d", "empty", "structured", "object", "big-endian"],
)
def test_array_kinds_round_trip(array):
    for inline in (65536, 0):
        value, _ = roundtrip(array, inline_bytes=inline)
        assert value.dtype == array.dtype and value.shape == array.shape
        assert (value == array).all() if array.size else True


def test_received_arrays_are_aligned_and_writable():
    value, _ = roundtrip([np.ones(3, dtype=np.int8), np.arange(7, dtype=np.complex128)])
    assert all(a.flags.aligned and a.flags.writeable for a in value)


def test_torch_tensors_round_trip():
    tensors = {
        "f32": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "bf16": torch.ones(5, dtype=torch.bfloat16),
        "grad": torch.zeros(3, requires_grad=True),
        "param": torch.nn.Parameter(torch.ones(2)),
        "strided": torch.arange(10.0)[::2],
    }
    value, encoded = roundtrip(tensors, inline_bytes=0)
    for name, tensor in tensors.items():
        got = value[name]
        assert type(got) is type(tensor) and got.dtype == tensor.dtype
        assert torch.equal(got.detach(), tensor.detach()) and got.requires_grad == tensor.requires_grad
