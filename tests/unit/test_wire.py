"""The compiled message path against its pure-Python reference: the same bytes, the same messages, the same errors.

The MPI side of the compiled path (``Endpoint``) runs under every MPI test of the suite; the mixed world of
``test_messaging.py`` has ranks on both paths talk to each other."""

import hashlib
import os
import random
import re
import struct
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import REPO

from mpiscale.runtime import compact, transport, wire

if os.environ.get(wire.PURE_ENV, "0") not in ("", "0"):
    pytest.skip(f"{wire.PURE_ENV} forces the reference: nothing compiled to compare", allow_module_level=True)
compiled, path = wire.chosen()  # launch/setup.sh builds it: a missing or stale build fails the build test below

ARRAY = np.arange(12, dtype=np.float32).reshape(3, 4)
MESSAGES = [
    (0, "bench.echo", "echo", (np.zeros(8, np.uint8),), {}, 17),
    (1, 17, ARRAY, False),
    (1, 2, None, True),
    ("x", {"a": 1, "b": 2.5, "c": None}, b"bytes", (1, "two", 3.0)),
    (0, "name", "method", (1, "s", np.array([True, False])), {"k": "v"}, -1),
    (),
    (10**40, -(2**63), 1e-300, float("inf"), "é", b""),
    (np.array(5, dtype=np.int64), np.zeros((0, 3)), np.arange(3, dtype=">i4")),
    tuple(range(300)),
]
NOT_COMPACT = [
    [1, 2],  # a list
    (np.float64(1.0),),  # a numpy scalar
    (True, {1: 2}),  # a key that is not a str
    ({"a": [1]},),  # a value that is not a scalar
    ((1, (2,)),),  # a tuple inside a tuple inside the message
    (np.zeros(compact.MAX_ARRAY_BYTES + 1, np.uint8),),  # over MAX_ARRAY_BYTES
    (np.zeros((4, 4))[:, ::2],),  # not contiguous
    (np.array(["a", 1], dtype=object),),  # holds objects
    (np.zeros(2).view(np.matrix),),  # a subclass
    (np.zeros(3, dtype=[("a", "i4")]),),  # structured
    ((np.zeros(2),) * 2,) * 2 + ([],),
    "a string",
    None,
]


def same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, tuple | list):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and (a == b or a != a and b != b)


def outcome(function, *args):
    """What ``function(*args)`` gives: ("value", v) or ("error", type, message)."""
    try:
        return ("value", function(*args))
    except Exception as error:
        return ("error", type(error), str(error))


def same_outcome(a, b) -> bool:
    if a[0] != b[0]:
        return False
    return a[1:] == b[1:] if a[0] == "error" else same(a[1], b[1])


@pytest.mark.parametrize("message", MESSAGES, ids=range(len(MESSAGES)))
def test_compact_bytes_and_messages_are_the_references(message):
    body = compiled.compact_encode(message)
    assert body == compact.encode(message)
    assert same(compiled.compact_decode(body), message) and same(compact.decode(body), message)
    frame = compiled.encode_compact(body, 2**40 + 3)
    assert frame == transport.encode_compact(body, 2**40 + 3)
    assert same(compiled.compact_messages(memoryview(frame)), [message])


@pytest.mark.parametrize("message", NOT_COMPACT, ids=range(len(NOT_COMPACT)))
def test_what_is_not_compact_is_refused_alike_and_pickled_alike(message):
    assert compiled.compact_encode(message) is None and compact.encode(message) is None
    assert compiled.compact_body(message, 65536) is None
    encoded = transport.encode(message, 4, 1 << 20)  # (inline: one frame, even past the compact limit)
    header = transport.decode_frame(memoryview(encoded.frame))
    assert same(compiled.load(header, header.inline_parts), message)
    assert compiled.compact_messages(memoryview(encoded.frame)) is None  # a pickled frame: the reference reads it


def test_a_body_over_the_limit_is_left_to_the_caller():
    message = (np.zeros(4000, np.uint8),)
    assert compiled.compact_body(message, 100) is None and transport.compact_body(message, 100) is None
    assert compiled.compact_body(message, 8192) == transport.compact_body(message, 8192)


def test_batches_are_the_references():
    bodies = [compact.encode((i, "m", np.full(i % 4, i))) for i in range(40)]
    for count in (0, 1, 2, 17, 40):
        frame = compiled.encode_batch(bodies[:count], 77)
        assert frame == transport.encode_batch(bodies[:count], 77)
        header = transport.decode_frame(memoryview(frame))
        assert same(compiled.load_batch(header), transport.load_batch(header))
        messages = compiled.compact_messages(memoryview(frame))  # (an empty batch, never sent, is left to transport)
        assert messages is None if count == 0 else same(messages, transport.load_batch(header))


def frames() -> list[bytes]:
    """Valid frames of every kind: compact, batch, pickled inline, pickled with its parts apart."""
    made = [transport.encode_compact(compact.encode(m), i) for i, m in enumerate(MESSAGES)]
    made.append(transport.encode_batch([compact.encode(m) for m in MESSAGES[:5]], 5))
    made += [transport.encode([1, {2: ARRAY}], 6, 65536).frame, transport.encode((ARRAY,) * 3, 7, 0).frame]
    return made


def test_damaged_frames_load_alike():
    """Truncated and extended frames, and frames with bits flipped anywhere, that the reference decodes: their
    messages load, or fail, alike on both paths (and nothing crashes)."""
    generator = random.Random(45)
    checked = 0
    for frame in frames():
        damaged = [frame[:cut] for cut in range(0, len(frame), max(1, len(frame) // 40))] + [frame + b"\0" * 9]
        for _ in range(300):
            flipped = bytearray(frame)
            for _ in range(generator.randint(1, 3)):
                flipped[generator.randrange(len(frame))] ^= 1 << generator.randrange(8)
            damaged.append(bytes(flipped))
        for candidate in damaged:
            decoded = outcome(transport.decode_frame, memoryview(candidate))
            if decoded[0] == "error":
                continue
            header = decoded[1]
            if header.inline_parts is not None and header.compact:
                if header.batch:
                    loaded, expected = outcome(compiled.load_batch, header), outcome(transport.load_batch, header)
                else:
                    loaded = outcome(compiled.load, header, header.inline_parts)
                    expected = outcome(transport.load, header, header.inline_parts)
                assert same_outcome(loaded, expected), candidate
            checked += 1
    assert checked > 100


def test_frames_read_where_they_arrive_give_the_references_messages_or_error():
    """``Endpoint.receive`` reads a complete compact frame at once (``compact_messages``): the reference's messages
    or its error. What it leaves (None) the engine reads with ``decode_frame``, as the reference does."""
    generator = random.Random(46)
    read_at_once = 0
    for frame in frames():
        candidates = [frame[:cut] for cut in range(len(frame))] + [frame + b"\0"]
        for _ in range(300):
            damaged = bytearray(frame)
            damaged[generator.randrange(len(damaged))] ^= 1 << generator.randrange(8)
            candidates.append(bytes(damaged))
        for candidate in candidates:
            mine = outcome(compiled.compact_messages, memoryview(candidate))
            if mine == ("value", None):
                continue
            header = transport.decode_frame(memoryview(candidate))
            assert header.inline_parts is not None and header.compact, candidate
            if header.batch:
                expected = outcome(transport.load_batch, header)
            else:
                expected = outcome(lambda h: [transport.load(h, h.inline_parts)], header)
            assert same_outcome(mine, expected), candidate
            read_at_once += mine[0] == "value"
    assert read_at_once > 50


class Delivered:
    """Where ``Endpoint.drain`` delivers (as the engine's dispatch) and counts (as the engine): a record of both."""

    def __init__(self) -> None:
        self.messages_received = self.bytes_received = 0
        self.calls: list = []

    def envelopes(self, source, messages) -> None:
        self.calls.append((source, [compact.encode(m) for m in messages]))


def drained(endpoint_kind, sent: list[bytes], behind: bool) -> tuple:
    """What ``drain`` makes of the frames ``sent`` to this process, called until nothing is left: each answer (a
    frame it left, with whether its bytes were there, or whether it delivered any), what it delivered and counted.
    ``behind``: a frame of this rank is queued already, so everything waits behind it."""
    from mpi4py import MPI

    comm = MPI.COMM_SELF.Dup()
    try:
        endpoint, into = endpoint_kind(MPI, comm), Delivered()
        pending = [endpoint.send(0, frame) for frame in sent]
        inbound = {0: ["a frame before"]} if behind else {}
        answers: list = []
        while True:
            found = endpoint.drain(inbound, into, into)
            if found is False:
                break
            if found is True:
                answers.append(True)
                continue
            source, frame, request = found
            if request is not None:
                request.Wait()
            answers.append((source, bytes(frame), request is None))
        MPI.Request.Waitall([request for request in pending if request is not None])
        return answers, into.calls, into.messages_received, into.bytes_received
    finally:
        comm.Free()


@pytest.mark.parametrize("behind", [False, True], ids=["first", "behind-a-queued-frame"])
def test_drain_delivers_and_leaves_the_references_frames(behind):
    """``Endpoint.drain`` on both paths, over frames of every kind sent to this process (compact, batches in and
    over the scratch buffer, pickled ones inline and with parts apart, damaged ones): the same deliveries in the
    same calls, the same counts, the same frames left to the engine in the same order. Behind a queued frame of
    their source, every frame is left."""
    big_batch = transport.encode_batch([compact.encode(m) for m in MESSAGES * 3], 9)
    damaged = bytearray(transport.encode_compact(compact.encode(MESSAGES[0]), 10))
    damaged[0] ^= 1  # not an mpiscale frame: left to the engine, which refuses it
    sent = frames()[:3] + [big_batch, bytes(damaged)] + frames()[3:] + frames()[:2]
    assert len(big_batch) > 4096 > max(map(len, frames()))
    mine, expected = drained(compiled.Endpoint, sent, behind), drained(wire.Endpoint, sent, behind)
    assert mine == expected
    answers, calls, messages, nbytes = expected
    left = [answer for answer in answers if answer is not True]
    if behind:
        assert not calls and messages == nbytes == 0 and [frame for _, frame, _ in left] == sent
    else:
        assert [frame for _, frame, _ in left] == [bytes(damaged)] + frames()[len(MESSAGES) + 1 :]
        single_then_big, after_damaged = [1, 1, 1, 3 * len(MESSAGES)], [1] * (len(MESSAGES) - 3) + [5]
        assert [len(batch) for _, batch in calls] == single_then_big + after_damaged + [1, 1]
        assert messages == sum(len(batch) for _, batch in calls) and nbytes > len(big_batch)


def count(tag: bytes, n: int) -> bytes:
    return tag + struct.pack("<I", n)


def array_entry(code: bytes, shape: tuple, data: bytes = b"") -> bytes:
    return b"a" + bytes((len(code),)) + code + bytes((len(shape),)) + struct.pack(f"<{len(shape)}q", *shape) + data


ONE = count(b"t", 1)  # the head of a message of one item
NOT_THERE = "is not what a compact message holds there"
NOT_PLAIN = "not a plain dtype's"
#: Bodies no encoder writes, each refused for a reason of its own (the byte named is where it begins).
CRAFTED = [
    (b"", "it ends early at byte 0"),
    (b"N", "byte 0 (0x4e) " + NOT_THERE),  # the top level is not a tuple
    (count(b"t", 2**32 - 1), "it ends early at byte 5"),  # 2**32 - 1 items declared, none there
    (ONE + count(b"s", 2**31) + b"ab", "it ends early at byte 10"),
    (ONE + ONE + count(b"t", 0), "byte 10 (0x74) " + NOT_THERE),
    (
        ONE + count(b"m", 1) + b"i" + bytes(8) + b"N",
        "byte 10 (0x69) " + NOT_THERE,
    ),
    (
        ONE + count(b"m", 1) + count(b"s", 1) + b"k" + array_entry(b"|u1", (1,), b"x"),
        "byte 16 (0x61) " + NOT_THERE,
    ),  # an array in a dict
    (ONE + b"Nx", "1 bytes follow the message"),
    (ONE + count(b"s", 2) + b"\xff\xfe", "the text at byte 10 is not UTF-8"),
    (
        ONE + array_entry(b"|O8", (1,), bytes(8)),
        "the array at byte 5 has dtype code b'|O8', " + NOT_PLAIN,
    ),
    (ONE + array_entry(b"\xe9", (1,)), "the array at byte 5 has dtype code b'\\xe9', " + NOT_PLAIN),
    (ONE + array_entry(b"|V0", (1,)), "the array at byte 5 has dtype code b'|V0', " + NOT_PLAIN),
    (ONE + array_entry(b"<i4", (1,) * 33), "the array at byte 5 has 33 dimensions, over 32"),
    (ONE + array_entry(b"<i4", (-1,)), "the array at byte 5 has an extent of -1"),
    (ONE + array_entry(b"<i4", (1 << 30, 1 << 11)), "the array at byte 5 has an extent of 2048"),
    (ONE + array_entry(b"|V65536", (1 << 40,)), "it ends early at byte 23"),  # 2**56 bytes declared
    (ONE + array_entry(b"<f8", (3,), bytes(8)), "it ends early at byte 19"),
]


@pytest.mark.filterwarnings("ignore:Data type alias:DeprecationWarning")  # numpy, of a damaged dtype code
def test_malformed_bodies_are_refused_alike():
    """Truncated, damaged and random bodies, and bodies no encoder writes: the same message or the same error on
    both paths."""
    generator = random.Random(7)
    bodies = [compact.encode(m) for m in MESSAGES]
    candidates = [b"", b"\x00", b"not compact", "a str", b"\xe9" * 40, bytearray(b"N"), memoryview(b"t")]
    candidates += [body[:cut] for body in bodies for cut in range(len(body))]
    candidates += [generator.randbytes(generator.randint(1, 64)) for _ in range(2000)]
    candidates += [b"t" + generator.randbytes(generator.randint(1, 64)) for _ in range(2000)]
    for body in bodies:
        for _ in range(200):
            damaged = bytearray(body)
            damaged[generator.randrange(len(damaged))] = generator.randrange(256)
            candidates.append(bytes(damaged))
    candidates += [body for body, _ in CRAFTED]
    decoded = 0
    for body in candidates:
        mine, expected = outcome(compiled.compact_decode, body), outcome(compact.decode, body)
        assert same_outcome(mine, expected), body
        decoded += mine[0] == "value"
    assert decoded > 100


@pytest.mark.parametrize(("body", "error"), CRAFTED, ids=range(len(CRAFTED)))
def test_a_body_no_encoder_writes_is_refused_naming_its_byte(body, error):
    for decode in (compiled.compact_decode, compact.decode):
        with pytest.raises(compact.NotCompact, match=f"^not a compact message: {re.escape(error)}$"):
            decode(body)


@pytest.mark.parametrize("inline", [False, True], ids=["apart", "inline"])
@pytest.mark.parametrize(
    "array",
    [
        ARRAY,
        np.zeros(0, np.int8),
        np.array(3.5),
        np.arange(40, dtype=">u2")[::-1].copy(),
        np.ones((1, 2, 1, 3, 1, 2, 1), np.complex64),
        np.zeros(70_000, np.uint8),
    ],
)
def test_a_channels_header_and_bytes_are_the_references(array, inline):
    """``Endpoint.send_array`` on both paths, to this process: the same header words and the same bytes, in the
    header's message or in one of their own."""
    from mpi4py import MPI

    fields = (0x6D70_6973_6368_616E, 3, 1, array.nbytes, 7, -8, 2**40, 11)
    got = []
    for endpoint in (compiled.Endpoint(MPI, MPI.COMM_SELF), wire.Endpoint(MPI, MPI.COMM_SELF)):
        pending = endpoint.send_array(0, 5, 6, fields, array, inline)
        head = 8 * (len(fields) + 1 + array.ndim)
        message, data = np.zeros(head + array.nbytes, np.uint8), np.empty(array.nbytes, np.uint8)
        status = MPI.Status()
        MPI.COMM_SELF.Recv([message, MPI.BYTE], 0, 5, status)
        assert status.Get_count(MPI.BYTE) == head + (array.nbytes if inline else 0)
        if inline:
            data[:] = message[head:]
        else:
            MPI.COMM_SELF.Recv([data, MPI.BYTE], 0, 6)
        MPI.Request.Waitall(pending)
        got.append((message[:head].view(np.int64).tolist(), data.tobytes()))
    assert got[0] == got[1] == ([*fields, array.ndim, *array.shape], array.tobytes())


def test_the_build_is_current_and_says_what_it_was_built_against():
    from mpi4py import MPI

    assert compiled.BUILT_AGAINST == MPI.Get_library_version().replace("\0", "").splitlines()[0].strip()
    assert path == "compiled" and wire.message_path() == ("compiled", True)


def test_a_build_of_other_source_or_another_mpi_is_not_used(tmp_path):
    source = tmp_path / "_wire.pyx"
    source.write_text("the source it was built from")
    built = SimpleNamespace(SOURCE_SHA256=hashlib.sha256(source.read_bytes()).hexdigest(), BUILT_AGAINST="MPI A, 1")
    assert wire.stale_build(built, source, "MPI A, 1\nmore lines\0") is None
    assert wire.stale_build(built, source, "MPI B, 2") == "the compiled module was built against MPI A, 1, not MPI B, 2"
    source.write_text("edited since")
    assert wire.stale_build(built, source, "MPI A, 1") == "the compiled module is older than _wire.pyx"
    assert wire.stale_build(built, tmp_path / "absent.pyx", "MPI A, 1") is None  # an installed package: no source


def test_the_reference_runs_when_asked_and_doctor_says_which_path():
    """MPISCALE_PURE_PYTHON=1 forces the reference in a process of its own; ``mpiscale doctor`` names the path."""
    code = "from mpiscale.runtime import wire; print(wire.chosen()[1])"
    environment = {**os.environ, wire.PURE_ENV: "1"}
    forced = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True, cwd=REPO)
    assert forced.stdout.strip() == f"pure-Python ({wire.PURE_ENV}=1)", forced.stderr
    doctor = subprocess.run([sys.executable, "-m", "mpiscale.cli", "doctor"], capture_output=True, text=True, cwd=REPO)
    assert re.search(r"^\[ok  \] message path +compiled$", doctor.stdout, re.MULTILINE), doctor.stdout


@pytest.mark.parametrize("count", [3, 40], ids=["on-the-stack", "more-than-the-stack"])
def test_the_engines_testsome_is_the_references(count):
    """The pending requests of the engine tested at once on both paths: the same indices, and every request left as
    MPI left it (completed ones null, the others still pending), over arrays on the stack and beyond them."""
    from mpi4py import MPI

    comm = MPI.COMM_SELF.Dup()
    try:
        outcomes = []
        for testsome in (compiled.testsome, wire.PURE.testsome):
            buffers = [np.zeros(4, np.int64) for _ in range(count)]
            waiting = [comm.Irecv(buffer, 0, 100 + i) for i, buffer in enumerate(buffers)]  # every third completes
            for i in range(0, count, 3):
                comm.Send(np.full(4, i, np.int64), 0, 100 + i)
            items = [SimpleNamespace(request=request) for request in [MPI.Request(), *waiting]]
            indices = testsome(MPI, items)
            nulls = [item.request == MPI.REQUEST_NULL for item in items]
            outcomes.append((sorted(indices), nulls, [int(b[0]) for b in buffers]))
            for item in items[1:]:
                if item.request != MPI.REQUEST_NULL:
                    item.request.Cancel()
                    item.request.Wait()
            assert testsome(MPI, [SimpleNamespace(request=MPI.Request())]) is None  # nothing but null requests
    finally:
        comm.Free()
    assert outcomes[0] == outcomes[1]
    indices, nulls, values = outcomes[0]
    assert indices == [1 + i for i in range(0, count, 3)] and nulls == [True] + [i % 3 == 0 for i in range(count)]
    assert values == [i if i % 3 == 0 else 0 for i in range(count)]
