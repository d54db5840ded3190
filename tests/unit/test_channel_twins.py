"""A channel's compiled ends against their references, in one process over ``COMM_SELF``: the same messages on
the wire, the same arrays delivered in the same order, the same buffers reused, the same refusals.

The channel runs between real ranks on both paths under ``tests/mpi/test_channels.py`` (``make test`` reruns it
with ``MPISCALE_PURE_PYTHON=1``); here each twin meets the other end's twin too, with streams that reach every
case: inline arrays, arrays that fill a lane's buffer or overflow it, arrays over a chunk, held views."""

import os

import numpy as np
import pytest

from mpiscale.runtime import channel_format, channel_receive, channel_send, wire
from mpiscale.runtime.errors import TransportError

if os.environ.get(wire.PURE_ENV, "0") not in ("", "0"):
    pytest.skip(f"{wire.PURE_ENV} forces the reference: nothing compiled to compare", allow_module_level=True)
compiled = wire.chosen()[0]
MPI = pytest.importorskip("mpi4py.MPI")

LANES, CHUNK = 4, 64 * 1024
SENDERS = {"compiled": compiled.ChannelSender, "reference": channel_send.Sender}
RECEIVERS = {"compiled": compiled.ChannelReceiver, "reference": channel_receive.Receiver}


class Traffic:
    """The progress engine's part in a channel, recorded: sends kept until done, counts."""

    def __init__(self) -> None:
        self.pending: list = []
        self.kept: list = []
        self.messages_sent = self.bytes_sent = self.messages_received = self.bytes_received = self.kicks = 0

    def track(self, request, what: str, keep: object) -> None:
        self.pending.append(request)
        self.kept.append((what, keep is None))

    def count_sent(self, messages: int, nbytes: int) -> None:
        self.messages_sent += messages
        self.bytes_sent += nbytes

    def kick(self) -> None:
        self.kicks += 1


def _stream() -> list[tuple[int, tuple[int, int, int], np.ndarray]]:
    """(lane, key, array): every dtype in both byte orders inline, then per lane a first array, arrays that fit
    its buffer (smaller ones too, of other shapes), one over it, one over a chunk, empty and 0-d arrays."""
    rng = np.random.default_rng(7)
    stream = []
    for code, dtype in channel_format.DTYPES.items():
        values = rng.integers(0, 100, 12).astype(dtype)
        stream.append((0, (code, -1, 2**40), values.reshape(3, 4)))
    for lane in (1, 2):
        for index, shape in enumerate([(64, 32), (64, 32), (16, 8, 10), (2, 1, 1, 1, 1, 1, 1), (64, 32), (80, 32),
                                       (600, 32), (0, 5), (), (64, 32), (64, 32), (64, 32)]):  # fmt: skip
            stream.append((lane, (lane, index, 0), rng.standard_normal(shape).astype(np.float32)))
    return stream


def _drain(receiver, traffic: Traffic, delivered: list, expected: int) -> None:
    for _ in range(100_000):
        receiver.poll()
        if len(delivered) >= expected:
            break
    MPI.Request.Waitall(traffic.pending)


def _run(sender_kind: str, receiver_kind: str, hold: bool, at_once: int, handed: list | None = None):
    """The stream from one twin to the other, ``at_once`` arrays sent before the receiver polls: what was
    delivered (as copies, and which of its lane's kept buffers each array is a view of), the counts, and each
    lane's capacity and kept buffers (``handed``: where the compiled receiver left a header to its reference)."""
    comm = MPI.COMM_SELF.Dup()
    traffic = Traffic()
    delivered: list = []
    held: list = []

    def deliver(source, lane, key, array):
        kept = _reference(receiver).receiving[(source, lane)].buffers
        where = next((i for i, buffer in enumerate(kept) if np.shares_memory(array, buffer)), -1)
        delivered.append((source, lane, key, array.dtype.str, array.shape, array.tobytes(), array.flags.writeable,
                          where))  # fmt: skip
        if hold:
            held.append(array)  # a view kept: its buffer must not be posted again

    try:
        receiver = RECEIVERS[receiver_kind](MPI, comm, traffic, "twins", LANES, CHUNK, deliver)
        sender = SENDERS[sender_kind](MPI, comm, compiled.Endpoint(MPI, comm), traffic, "twins", LANES, CHUNK,
                                      channel_format.INLINE_BYTES)  # fmt: skip
        if handed is not None:  # count what the compiled receiver leaves to its reference
            reference = receiver.reference
            header_arrived = reference.header_arrived
            reference.header_arrived = lambda source, slot, count: (
                handed.append(len(delivered)) or header_arrived(source, slot, count)
            )
        stream = _stream()
        for part in (stream[start : start + at_once] for start in range(0, len(stream), at_once)):
            for lane, key, array in part:
                sender.send(0, lane, key, array)
            _drain(receiver, traffic, delivered, len(delivered) + len(part))
        for (lane, key, array), got in zip(stream, delivered):
            assert got[1:6] == (lane, key, array.dtype.str, array.shape, array.tobytes()), got[1:5]
        if hold:  # every view still holds what arrived in it
            assert [a.tobytes() for a in held] == [array.tobytes() for _, _, array in stream]
        receiver.cancel()
        counts = (traffic.messages_sent, traffic.bytes_sent, traffic.messages_received, traffic.bytes_received,
                  traffic.kicks, traffic.kept)  # fmt: skip
        lanes = {k: (lane.capacity, len(lane.buffers)) for k, lane in _reference(receiver).receiving.items()}
        return [d[:7] for d in delivered], [d[7] for d in delivered], counts, lanes
    finally:
        comm.Free()


def _reference(end):
    return getattr(end, "reference", end)


LANE = [-1, 0, 1, -1, None, -1, -1, -1, -1, None, None, None]  # per lane: where each array lands (-1: not a kept
# buffer; over, inline or a buffer of its own), its fit arrays' places depending on what still holds a buffer


@pytest.mark.parametrize(
    "hold, at_once, fits",
    [
        (False, 1, [0, 1, 0, 1]),  # let go at once: the buffer that just filled and the one posted take turns
        (True, 1, [2, 3, -1, -1]),  # held: each its own buffer, 4 kept, then buffers of their own, let go later
        (False, 64, None),  # all sent before any arrives: buffers wait behind the lane's earlier arrays
    ],
    ids=["one-by-one", "held", "all-at-once"],
)
def test_every_pairing_of_twins_delivers_the_same_arrays_into_the_same_buffers(hold, at_once, fits):
    runs = {(s, r): _run(s, r, hold, at_once) for s in SENDERS for r in RECEIVERS}
    first = runs[("reference", "reference")]
    for pairing, run in runs.items():
        assert run == first, pairing
    delivered, places, counts, lanes = first
    assert counts[0] == counts[2] == len(delivered) and counts[1] == counts[3]
    assert lanes == {(0, 0): (None, 0), (0, 1): (8192, 2 if fits == [0, 1, 0, 1] else 4), (0, 2): lanes[(0, 1)]}
    assert places[:32] == [-1] * 32  # every dtype inline
    if fits is not None:
        order = iter(fits)
        lane = [next(order) if where is None else where for where in LANE]
        assert places[32:] == lane + lane


def test_the_compiled_receiver_leaves_only_a_lanes_first_overflowing_and_queued_inline_arrays_to_its_reference():
    handed: list = []
    _run("compiled", "compiled", False, 1, handed)
    lane = [32, 37, 38]  # each lane's first, the array over its buffer, the array over a chunk
    assert handed == [0] + lane + [n + len(LANE) for n in lane]
    at_once: list = []  # all sent first: the fit arrays wait for their data, queued in C
    _run("compiled", "compiled", False, 64, at_once)
    assert at_once == [0] + [32] * 12  # per lane its first, over-buffer, over-chunk and 3 inline arrays behind others


def test_the_compiled_sender_leaves_only_a_lanes_first_and_arrays_over_a_chunk_to_its_reference():
    comm = MPI.COMM_SELF.Dup()
    try:
        traffic, handed = Traffic(), []
        sender = compiled.ChannelSender(MPI, comm, compiled.Endpoint(MPI, comm), traffic, "twins", LANES, CHUNK, 4096)
        send = sender.reference.send
        sender.reference.send = lambda dest, lane, key, array: handed.append(key) or send(dest, lane, key, array)
        receiver = compiled.ChannelReceiver(MPI, comm, traffic, "twins", LANES, CHUNK, lambda *args: None)
        for lane, key, array in _stream():
            sender.send(0, lane, key, array)
            receiver.poll()
        _drain(receiver, traffic, [], 0)
        receiver.cancel()
    finally:
        comm.Free()
    assert handed == [(0, -1, 2**40), (1, 0, 0), (1, 6, 0), (2, 0, 0), (2, 6, 0)]


def _raw_headers(sender_kind: str) -> list:
    comm = MPI.COMM_SELF.Dup()
    try:
        traffic = Traffic()
        sender = SENDERS[sender_kind](MPI, comm, compiled.Endpoint(MPI, comm), traffic, "twins", LANES, CHUNK, 4096)
        words = []
        for lane, key, array in _stream():
            sender.send(0, lane, key, array)
            status = MPI.Status()
            comm.Probe(0, channel_format.HEADER_TAG, status)
            message = np.empty(status.Get_count(MPI.BYTE), np.uint8)
            comm.Recv([message, MPI.BYTE], 0, channel_format.HEADER_TAG)
            head = channel_format.header_bytes(array.ndim)
            words.append((message[:head].view(np.int64).tolist(), message[head:].tobytes()))
            left = array.nbytes if array.nbytes > 4096 else 0
            while left:  # its bytes, in one message or in chunks
                comm.Probe(0, MPI.ANY_TAG, status)
                data = np.empty(status.Get_count(MPI.BYTE), np.uint8)
                comm.Recv([data, MPI.BYTE], 0, status.Get_tag())
                words.append((status.Get_tag(), data.tobytes()))
                left -= len(data)
        MPI.Request.Waitall(traffic.pending)
        return words
    finally:
        comm.Free()


def test_the_compiled_sender_puts_the_references_messages_on_the_wire():
    assert _raw_headers("compiled") == _raw_headers("reference")


def _refusal(receiver_kind: str, header: np.ndarray, count: int) -> str:
    comm = MPI.COMM_SELF.Dup()
    try:
        receiver = RECEIVERS[receiver_kind](MPI, comm, Traffic(), "twins", LANES, CHUNK, lambda *args: None)
        comm.Send([header.view(np.uint8)[:count], MPI.BYTE], 0, channel_format.HEADER_TAG)
        with pytest.raises(TransportError) as refused:
            for _ in range(1000):
                receiver.poll()
        _reference(receiver).cancel()
        return str(refused.value)
    finally:
        comm.Free()


def _header(**changes) -> np.ndarray:
    words = dict(magic=channel_format.MAGIC, lane=1, mode=channel_format.INLINE, nbytes=24, k0=1, k1=2, k2=3,
                 code=channel_format.CODES[np.dtype("<f8")], ndim=1, d0=3)  # fmt: skip
    words.update(d1=0, d2=0, d3=0, d4=0, d5=0, d6=0)
    words.update(changes)
    return np.array(list(words.values()), np.int64)


@pytest.mark.parametrize(
    "changes, count, says",
    [
        ({"magic": 5}, 104, "is not one of its headers"),
        ({}, 40, "is not one of its headers"),
        ({"lane": LANES}, 104, f"has lane {LANES}, mode 2, 1 dims, 24 bytes"),
        ({"mode": 3}, 104, "has lane 1, mode 3, 1 dims, 24 bytes"),
        ({"ndim": 8}, 104, "has lane 1, mode 2, 8 dims, 24 bytes"),
        ({"nbytes": -8}, 104, "has lane 1, mode 2, 1 dims, -8 bytes"),
        ({"nbytes": 5000, "d0": 625}, 104, "has lane 1, mode 2, 1 dims, 5000 bytes"),
        ({"code": 10_000}, 104, "names no dtype of plain numbers (code 10000)"),
        ({"code": -1}, 104, "names no dtype of plain numbers (code -1)"),
        ({"d0": 4}, 104, "gives shape (4,) of float64 for 24 bytes"),
        ({"d0": -3}, 104, "gives shape (-3,) of float64 for 24 bytes"),
        ({"ndim": 2, "d0": 2**62, "d1": 2**62}, 112, "gives shape (4611686018427387904, 4611686018427387904)"),
        ({}, 80, "came in a message of 80 bytes, not 104"),
        (
            {"mode": channel_format.FIT},
            80,
            "sent 24 bytes on lane 1 as fitting the lane's buffer, and it has no buffer (nothing came on it before)",
        ),  # fmt: skip
    ],
)
def test_both_receivers_refuse_a_header_that_is_not_one_with_the_same_words(changes, count, says):
    header = _header(**changes)
    refusals = {kind: _refusal(kind, header, count) for kind in RECEIVERS}
    assert refusals["compiled"] == refusals["reference"]
    assert refusals["compiled"].startswith("channel 'twins': ") and says in refusals["compiled"]


@pytest.mark.parametrize(
    "array, lane, error, says",
    [
        (np.zeros((4, 4))[:, 1], 0, ValueError, "sends C-contiguous arrays"),
        (np.array(["a"], object), 0, TypeError, "got a object array of 1 dims"),
        (np.zeros((1,) * 8), 0, TypeError, "at most 7 dims, got a float64 array of 8 dims"),
        ([1.0, 2.0], 0, TypeError, "got a list"),
        (np.zeros(3), LANES, ValueError, f"lane {LANES} is outside 0..{LANES - 1}"),
        (np.zeros(3), -1, ValueError, f"lane -1 is outside 0..{LANES - 1}"),
    ],
)
def test_both_senders_refuse_what_cannot_travel_with_the_same_words(array, lane, error, says):
    comm = MPI.COMM_SELF.Dup()
    try:
        messages = []
        for kind in SENDERS:
            sender = SENDERS[kind](MPI, comm, compiled.Endpoint(MPI, comm), Traffic(), "twins", LANES, CHUNK, 4096)
            sender.send(0, 0, (0, 0, 0), np.zeros(3))  # the lane exists: the compiled sender's own checks run
            with pytest.raises(error) as refused:
                sender.send(0, lane, (1, 0, 0), array)
            messages.append(str(refused.value))
            sender.close()
            with pytest.raises(RuntimeError, match="channel 'twins' is closed"):
                sender.send(0, 0, (2, 0, 0), np.zeros(3))
        while comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG):
            comm.Recv([np.empty(4096, np.uint8), MPI.BYTE], MPI.ANY_SOURCE, MPI.ANY_TAG)
    finally:
        comm.Free()
    assert messages[0] == messages[1] and says in messages[0]
