"""Message encoding without MPI: frames, inline and separate parts, compact messages."""

import copyreg
import enum
import gc
import mmap
import struct
import weakref

import numpy as np
import pytest
import torch

from mpiscale.runtime import compact, transport


def roundtrip(obj, inline_bytes=65536):
    encoded = transport.encode(obj, seq=5, inline_bytes=inline_bytes)
    frame = memoryview(bytearray(encoded.frame))
    header = transport.decode_frame(frame)
    assert header.seq == 5
    if header.inline_parts is not None:
        assert encoded.parts == []
        return transport.load(header, header.inline_parts), encoded
    received = [transport.allocate(n) for n in header.sizes]
    for source, target in zip(encoded.parts, received):
        target[:] = source
    return transport.load(header, received), encoded


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


def test_the_serializer_keeps_nothing_it_pickled_alive():
    """Its pickler is reused; its memo must not hold the last message: a sent 16 MiB reply kept alive there held its
    pooled receive buffer, and an echoing rank received every other message into a second one."""
    array = np.ones(1000)
    message = (1, "reply", array)
    parts = transport.serialize(message)
    assert np.shares_memory(np.frombuffer(parts[1], np.float64), array)
    held = weakref.ref(array)
    del message, array, parts
    gc.collect()
    assert held() is None


def test_large_receive_buffers_are_mappings_of_their_own():
    """Past the pool's 1 MiB floor, a receive buffer is fresh anonymous memory (the kernel may back it with huge
    pages), writable, of the size asked; the pool hands the same one out again once it is dropped."""
    pool = transport.BufferPool(max_bytes=64 << 20)
    first = pool.take(3 << 20)
    first[:] = b"\x01" * (3 << 20)
    address = np.frombuffer(first, np.uint8).ctypes.data
    assert isinstance(first.obj.base.obj, mmap.mmap) and first.nbytes == 3 << 20
    del first
    assert np.frombuffer(pool.take(3 << 20), np.uint8).ctypes.data == address
    unpooled = transport.allocate(2 << 20)
    assert isinstance(unpooled.obj.base.obj, mmap.mmap) and not unpooled.readonly


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
        np.arange(5).astype("datetime64[s]"),
        np.asfortranarray(np.arange(6).reshape(2, 3).astype(">m8[ms]")),
        np.array(7).astype("datetime64[D]"),
    ],
    ids=["fortran", "strided", "0d", "empty", "structured", "object", "big-endian", "dates", "durations", "0d-date"],
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
        "float8": torch.arange(6.0).to(torch.float8_e4m3fn),  # numpy has no such dtype, and torch's own pickle fails
        "conjugate": (torch.arange(3.0) * 1j).conj(),  # a lazy bit numpy cannot see: sent resolved
        "negative": torch.arange(3.0).to(torch.complex64).conj().imag,  # a view with the negative bit
        "sparse": torch.eye(3).to_sparse(),  # left to torch's pickle, whose layouts copyreg knows
    }
    value, encoded = roundtrip(tensors, inline_bytes=0)
    for name, tensor in tensors.items():
        got, want = value[name], tensor.detach()
        assert type(got) is type(tensor) and got.dtype == tensor.dtype and got.layout == tensor.layout, name
        if want.dtype == torch.float8_e4m3fn:
            got, want = got.view(torch.uint8), want.view(torch.uint8)
        assert torch.equal(got.detach().to_dense().resolve_conj(), want.to_dense().resolve_conj()), name
        assert got.requires_grad == tensor.requires_grad


class Registered:
    """A class pickled by a reducer registered with ``copyreg``, as libraries register theirs."""

    def __init__(self, value):
        self.value = value


def test_reducers_registered_with_copyreg_are_used():
    copyreg.pickle(Registered, lambda obj: (Registered, (obj.value * 10,)))
    try:
        first, _ = roundtrip({"x": Registered(4)}, inline_bytes=0)
        copyreg.pickle(Registered, lambda obj: (Registered, (obj.value * 100,)))  # registered again: the new one
        second, _ = roundtrip({"x": Registered(4)}, inline_bytes=0)
    finally:
        del copyreg.dispatch_table[Registered]
    assert (first["x"].value, second["x"].value) == (40, 400)
    assert roundtrip(Registered(4))[0].value == 4  # and gone once removed


# ---- compact messages: small tuples of plain values travel without pickle


class Colour(enum.IntEnum):
    RED = 1


@pytest.mark.parametrize(
    "message",
    [
        (0, "actor", "method", (np.arange(3, dtype=np.float32), 1, "two", None), {}, 7),
        (1, 5, np.zeros((2, 3), dtype=">i4"), False),
        (True, 2**80, -0.0, float("inf"), b"\x00\xff", "ünïcode", {"k": 1.5, "flag": None}),
        ((), (np.array(2.5),), np.zeros((0, 4))),
    ],
    ids=["ask", "reply", "scalars", "0d-and-empty"],
)
def test_plain_tuples_travel_compact_and_keep_their_types(message):
    value, encoded = roundtrip(message)
    assert transport.decode_frame(memoryview(bytearray(encoded.frame))).compact
    assert type(value) is tuple and len(value) == len(message)
    for got, sent in zip(_flatten(value), _flatten(message)):
        assert type(got) is type(sent)
        if isinstance(sent, np.ndarray):
            assert got.dtype == sent.dtype and got.shape == sent.shape and np.array_equal(got, sent)
            assert got.flags.writeable and got.flags.c_contiguous
        else:
            assert got == sent or (got != got and sent != sent)


def _flatten(value):
    for item in value:
        yield from (_flatten(item) if type(item) is tuple else [item])


@pytest.mark.parametrize(
    "message",
    [
        (Colour.RED, 1),  # an int subclass keeps its class
        (np.float64(1.5),),  # numpy scalars stay numpy scalars
        (np.zeros(compact.MAX_ARRAY_BYTES + 1, dtype=np.uint8),),  # large arrays go out of band
        (np.asfortranarray(np.ones((2, 3))),),  # Fortran order is kept
        (np.array([1, None], dtype=object),),
        ([1, 2],),  # lists, nested tuples, dicts of non-plain values
        (((1,),),),
        ({"a": [1]},),
        {"not": "a tuple"},
    ],
    ids=["intenum", "np-scalar", "large-array", "fortran", "object-array", "list", "nested", "dict", "dict-top"],
)
def test_other_values_are_pickled_as_they_are(message):
    assert compact.encode(message) is None
    value, encoded = roundtrip(message)
    assert not transport.decode_frame(memoryview(bytearray(encoded.frame))).compact
    assert type(value) is type(message)
    if isinstance(message, tuple) and isinstance(message[0], np.ndarray):
        assert value[0].flags.f_contiguous == message[0].flags.f_contiguous and np.array_equal(value[0], message[0])


def _compact_frame(body: bytes) -> memoryview:
    frame = transport.encode((1,), seq=3, inline_bytes=65536).frame
    return memoryview(bytearray(frame[: len(frame) - len(compact.encode((1,)))]) + body)


def _array_entry(code: bytes, extent: int, data: bytes) -> bytes:
    return b"a" + bytes((len(code),)) + code + b"\x01" + struct.pack("<q", extent) + data


@pytest.mark.parametrize(
    "body",
    [
        b"\xff\x00garbage",
        b"t\x01\x00\x00\x00[",  # a value of a type it never holds
        b"t\x01\x00\x00\x00N\x00",  # a byte after the message
        b"t\x01\x00\x00\x00" + _array_entry(b"|O8", 1, b"\x00" * 8),  # an object dtype
        b"t\x01\x00\x00\x00" + _array_entry(b"<f8", 3, b"\x00" * 8),  # a shape its bytes do not fill
    ],
    ids=["garbage", "foreign-type", "trailing-byte", "object-dtype", "short-data"],
)
def test_a_corrupt_compact_frame_is_a_transport_error(body):
    frame = _compact_frame(body)
    struct.pack_into("<Q", frame, 16, len(body))
    header = transport.decode_frame(frame)
    assert header.compact
    with pytest.raises(transport.TransportError, match="seq 3: not a compact message"):
        transport.load(header, header.inline_parts)


def test_a_batch_frame_carries_its_messages_in_order():
    messages = [(0, "actor", "add", (i, np.full(2, i)), {}, -1) for i in range(5)]
    bodies = [transport.compact_body(m, 65536) for m in messages]
    header = transport.decode_frame(memoryview(bytearray(transport.encode_batch(bodies, seq=9))))
    assert header.batch and header.seq == 9
    for got, sent in zip(transport.load_batch(header), messages, strict=True):
        assert got[:3] == sent[:3] and got[3][0] == sent[3][0] and np.array_equal(got[3][1], sent[3][1])


def test_a_batch_frame_whose_sizes_disagree_with_it_is_refused():
    frame = bytearray(transport.encode_batch([transport.compact_body((1,), 100)] * 3, seq=1))
    with pytest.raises(transport.TransportError, match="holds"):
        transport.decode_frame(memoryview(frame + b"\x00"))
    with pytest.raises(transport.TransportError, match="part table"):
        transport.decode_frame(memoryview(frame[:20]))
