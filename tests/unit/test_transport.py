"""Message encoding without MPI: frames, inline and separate parts, chunks."""

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


def test_chunks_cover_the_buffer_exactly():
    data = memoryview(bytes(range(256)) * 40)
    pieces = list(transport.chunks(data, 1000))
    assert [p.nbytes for p in pieces] == [1000] * 10 + [240]
    assert b"".join(pieces) == data.tobytes()
    assert [p.nbytes for p in transport.chunks(memoryview(b""), 10)] == [0]


def test_data_tags_stay_within_the_tag_bound():
    assert all(2 <= transport.data_tag(seq, 32767) <= 32767 for seq in (0, 1, 32765, 32766, 10**9))


@pytest.mark.parametrize("frame", [b"", b"XXXXYYYYZZZZWWWW", b"MPSC"])
def test_foreign_frames_are_rejected(frame):
    with pytest.raises(transport.TransportError):
        transport.decode_frame(memoryview(frame))


def test_truncated_inline_frame_is_rejected():
    encoded = transport.encode(np.arange(100), seq=1, inline_bytes=65536)
    with pytest.raises(transport.TransportError):
        transport.decode_frame(memoryview(encoded.frame[:-8]))


def test_buffer_pool_reuses_only_unreferenced_buffers():
    pool = transport.BufferPool(max_bytes=64 << 20)
    size = 2 << 20
    first = pool.take(size)
    in_use = np.frombuffer(first, dtype=np.float64)  # user code keeps a view
    del first
    second = pool.take(size)
    assert not np.shares_memory(np.frombuffer(second, np.uint8), in_use), "handed out a buffer still in use"
    del second
    # an array rebuilt by unpickling keeps its buffer busy too
    parts = transport.serialize(np.arange(size // 8, dtype=np.float64))
    buffer = pool.take(parts[1].nbytes)
    buffer[:] = parts[1]
    received = transport.deserialize([parts[0], buffer])
    del buffer
    third = pool.take(size)
    assert not np.shares_memory(np.frombuffer(third, np.uint8), received)
    assert not np.shares_memory(np.frombuffer(third, np.uint8), in_use)
    held = pool._held
    del third, received, in_use
    again = pool.take(size)
    assert pool._held == held, "a free buffer was not reused"
    assert np.frombuffer(again, np.uint8).nbytes == size


def test_buffer_pool_respects_its_limit():
    pool = transport.BufferPool(max_bytes=5 << 20)
    taken = [pool.take(2 << 20) for _ in range(4)]  # 8 MiB in use, only 4 MiB may be pooled
    assert pool._held <= 5 << 20 and len(taken) == 4
    del taken
    pool.take(3 << 20)  # frees the unreferenced ones to make room
    assert pool._held <= 5 << 20
