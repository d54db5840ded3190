# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The message path compiled: the frame header, the compact codec and the frames' MPI calls.

Each function here has a pure-Python twin that is the reference the tests hold it to, bit for bit on the wire:
``compact.encode``/``decode``, ``transport.compact_body``/``encode_compact``/``encode_batch``/``encode``/
``decode_frame``/``load``/``load_batch`` and ``wire.Endpoint``. ``wire`` picks this module where it is built and
current, the twins elsewhere (``launch/setup.sh`` builds it; ``MPISCALE_PURE_PYTHON=1`` forces the twins).

What makes it faster than the same Python compiled: the checks of a message's values are C type comparisons,
the header is written and read as bytes in C, marshal is called through its C API, and the frames' MPI calls go
straight to the MPI library (mpi4py's ``libmpi.pxd``), with no Python object per call but the frame itself.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_FromStringAndSize
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdint cimport uint32_t, uint64_t
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.string cimport memcpy
from mpi4py.libmpi cimport (
    MPI_ANY_SOURCE, MPI_BYTE, MPI_Comm, MPI_Get_count, MPI_Improbe, MPI_Imrecv, MPI_Isend, MPI_Message,
    MPI_Request, MPI_Status, MPI_STATUS_IGNORE, MPI_SUCCESS, MPI_Test,
)
from mpi4py.MPI cimport Comm, Request

from mpi4py import MPI

from . import compact, compact_check, transport

cdef extern from "marshal.h":
    object PyMarshal_WriteObjectToString(object value, int version)
    object PyMarshal_ReadObjectFromString(const char *data, Py_ssize_t length)
    int Py_MARSHAL_VERSION

cdef extern from *:
    """
    #ifndef MPISCALE_WIRE_SOURCE_SHA256
    #define MPISCALE_WIRE_SOURCE_SHA256 ""
    #endif
    #ifndef MPISCALE_WIRE_MPI_LIBRARY
    #define MPISCALE_WIRE_MPI_LIBRARY ""
    #endif
    """
    const char *SOURCE_DIGEST "MPISCALE_WIRE_SOURCE_SHA256"
    const char *MPI_LIBRARY "MPISCALE_WIRE_MPI_LIBRARY"

#: The SHA-256 of the source this module was built from (``wire`` refuses a build older than its source).
SOURCE_SHA256 = SOURCE_DIGEST.decode()
#: The first line of the MPI library version the module was built against (``wire`` checks the running one).
BUILT_AGAINST = MPI_LIBRARY.decode()

cdef uint32_t MAGIC = 0x4353504D
cdef uint32_t INLINE_BIT = 1u << 31
cdef uint32_t COMPACT_BIT = 1u << 30
cdef uint32_t BATCH_BIT = 1u << 29
cdef uint32_t COMPACT_COUNT = 1u | (1u << 31) | (1u << 30)
cdef Py_ssize_t HEADER = 16  # magic, part count, sequence: "<IIQ"
cdef Py_ssize_t COMPACT_HEAD = 24  # the header and the one part's size
cdef Py_ssize_t MAX_ARRAY_BYTES = compact.MAX_ARRAY_BYTES
cdef int FRAME_TAG = transport.FRAME_TAG

cdef object _ndarray
import numpy
_ndarray = numpy.ndarray
cdef object _array_entry = compact._array_entry
cdef object with_arrays = compact.with_arrays
cdef object NotCompact = compact.NotCompact
cdef object TransportError = transport.TransportError
cdef object FrameHeader = transport.FrameHeader
cdef object Encoded = transport.Encoded
cdef object encode_pickled = transport.encode_pickled
cdef object deserialize = transport.deserialize


# ------------------------------------------------------------------ the compact codec (compact.py)
cdef inline bint _scalar(object item):
    cdef type kind = type(item)
    return item is None or kind is int or kind is str or kind is float or kind is bool or kind is bytes


cdef bint _plain_dict(dict value):
    for key, item in value.items():
        if type(key) is not str or not _scalar(item):
            return False
    return True


cdef object _encode_inner(tuple values, Py_ssize_t outer, list positions):
    cdef Py_ssize_t index, count = len(values)
    cdef list replaced = None
    for index in range(count):
        item = values[index]
        if _scalar(item):
            continue
        if type(item) is not _ndarray or index >= 0xFFFF:
            return None
        entry = _array_entry(item)
        if entry is None:
            return None
        if replaced is None:
            replaced = list(values)
        replaced[index] = entry
        positions.append((outer << 16) + 1 + index)
    return values if replaced is None else tuple(replaced)


cpdef object compact_encode(object message):
    """``compact.encode``: the compact bytes of ``message``, or None when it does not qualify."""
    if type(message) is not tuple:
        return None
    cdef tuple values = <tuple>message
    cdef Py_ssize_t index, count = len(values)
    cdef list items = None
    cdef list positions = []
    cdef type kind
    for index in range(count):
        item = values[index]
        if _scalar(item):
            continue
        kind = type(item)
        if kind is _ndarray:
            entry = _array_entry(item)
            if entry is None:
                return None
            if items is None:
                items = list(values)
            items[index] = entry
            positions.append(index << 16)
        elif kind is tuple:
            inner = _encode_inner(<tuple>item, index, positions)
            if inner is None:
                return None
            if inner is not item:
                if items is None:
                    items = list(values)
                items[index] = inner
        elif kind is dict:
            if not _plain_dict(<dict>item):
                return None
        else:
            return None
    body = message if items is None else tuple(items)
    return PyMarshal_WriteObjectToString((body, tuple(positions)), Py_MARSHAL_VERSION)


cdef int MAX_DEPTH = compact_check.MAX_DEPTH


cdef int _fail(str why) except -1:
    raise NotCompact(f"not a compact message: {why}")


cdef inline int _need(Py_ssize_t length, Py_ssize_t at, Py_ssize_t count) except -1:
    if count > length - at:
        _fail(f"marshal data ends early at byte {at}")
    return 0


cdef inline long long _int32(const unsigned char *data, Py_ssize_t length, Py_ssize_t at) except? -1:
    _need(length, at, 4)
    return <int>_get32(data + at)


cdef inline Py_ssize_t _length(const unsigned char *data, Py_ssize_t length, Py_ssize_t at) except -1:
    cdef long long value = _int32(data, length, at)
    if value < 0:
        _fail(f"negative length at byte {at}")
    return <Py_ssize_t>value


cdef Py_ssize_t _object(const unsigned char *data, Py_ssize_t length, Py_ssize_t at, char *refs,
                        Py_ssize_t *count, int depth) except -1:
    """``compact_check._object``: the offset after the marshal object at ``at``, or NotCompact."""
    cdef Py_ssize_t start = at, size, index, items, item
    cdef long long reference
    cdef unsigned char code, kind
    cdef bint flagged
    if depth > MAX_DEPTH:
        _fail(f"nested deeper than {MAX_DEPTH} at byte {at}")
    _need(length, at, 1)
    code = data[at]
    kind, flagged = code & 0x7F, (code & 0x80) != 0
    at += 1
    if (kind == b'N' or kind == b'F' or kind == b'T') and not flagged:
        return at
    if kind == b'r' and not flagged:
        reference = _int32(data, length, at)
        if not (0 <= reference < count[0] and refs[reference]):
            _fail(f"a reference at byte {start} to an object not read yet")
        return at + 4
    if kind == b'i' or kind == b'g' or kind == b'l' or kind == b's' or kind == b'u' or kind == b't' \
            or kind == b'a' or kind == b'A' or kind == b'z' or kind == b'Z':
        if kind == b'i':
            size = 4
        elif kind == b'g':
            size = 8
        elif kind == b'l':
            reference = _int32(data, length, at)
            size, at = 2 * (reference if reference >= 0 else -reference), at + 4
        elif kind == b'z' or kind == b'Z':
            _need(length, at, 1)
            size, at = data[at], at + 1
        else:
            size, at = _length(data, length, at), at + 4
        _need(length, at, size)
        if flagged:
            refs[count[0]] = 1
            count[0] += 1
        return at + size
    if kind != b')' and kind != b'(' and kind != b'{':
        _fail(f"marshal type {code:#04x} at byte {start} is not one it holds")
    index = count[0]
    if flagged:
        refs[index] = 0
        count[0] += 1
    if kind == b'{':
        while True:
            _need(length, at, 1)
            if data[at] == b'0':
                at += 1
                break
            at = _object(data, length, _object(data, length, at, refs, count, depth + 1), refs, count, depth + 1)
    else:
        if kind == b')':
            _need(length, at, 1)
            items, at = data[at], at + 1
        else:
            items, at = _length(data, length, at), at + 4
        _need(length, at, items)
        for item in range(items):
            at = _object(data, length, at, refs, count, depth + 1)
    if flagged:
        refs[index] = 1
    return at


cdef object _loads(object data):
    """``compact.decode``'s check and ``marshal.loads`` of a compact body."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise NotCompact(f"not a compact message: {type(data).__name__} is not bytes")
    cdef Py_buffer view
    cdef Py_ssize_t count = 0, end
    cdef char *refs
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    refs = <char *>PyMem_Malloc(view.len + 1)  # each reference takes a byte of the data at least
    try:
        end = _object(<const unsigned char *>view.buf, view.len, 0, refs, &count, 0)
        if end != view.len:
            _fail(f"{view.len - end} bytes after the marshal data")
        try:
            return PyMarshal_ReadObjectFromString(<const char *>view.buf, view.len)
        except (ValueError, EOFError, TypeError) as error:
            raise NotCompact(f"not a compact message: {error}") from None
    finally:
        PyMem_Free(refs)
        PyBuffer_Release(&view)


cpdef tuple compact_decode(object data):
    """``compact.decode``: the message whose compact bytes are ``data``; NotCompact if they are not well formed."""
    loaded = _loads(data)
    if type(loaded) is not tuple or len(<tuple>loaded) != 2:
        raise NotCompact("not a compact message: wrong structure")
    body, positions = <tuple>loaded
    if type(body) is not tuple or type(positions) is not tuple:
        raise NotCompact("not a compact message: wrong structure")
    return with_arrays(body, positions) if positions else body


# ------------------------------------------------------------------ frames (transport.py)
cdef inline void _put32(char *at, uint32_t value) noexcept:
    at[0] = <char>(value & 0xFF)
    at[1] = <char>((value >> 8) & 0xFF)
    at[2] = <char>((value >> 16) & 0xFF)
    at[3] = <char>((value >> 24) & 0xFF)


cdef inline void _put64(char *at, uint64_t value) noexcept:
    _put32(at, <uint32_t>(value & 0xFFFFFFFFu))
    _put32(at + 4, <uint32_t>(value >> 32))


cdef inline uint32_t _get32(const unsigned char *at) noexcept:
    return at[0] | (<uint32_t>at[1] << 8) | (<uint32_t>at[2] << 16) | (<uint32_t>at[3] << 24)


cdef inline uint64_t _get64(const unsigned char *at) noexcept:
    return _get32(at) | (<uint64_t>_get32(at + 4) << 32)


cpdef object compact_body(object message, Py_ssize_t limit):
    """``transport.compact_body``: the compact bytes if ``message`` qualifies and they fit in ``limit``."""
    body = compact_encode(message)
    if body is None or PyBytes_GET_SIZE(body) > limit:
        return None
    return body


cpdef bytes encode_compact(bytes body, uint64_t seq):
    """``transport.encode_compact``: the frame of one compact message."""
    cdef Py_ssize_t size = PyBytes_GET_SIZE(body)
    cdef bytes frame = PyBytes_FromStringAndSize(NULL, COMPACT_HEAD + size)
    cdef char *out = PyBytes_AS_STRING(frame)
    _put32(out, MAGIC)
    _put32(out + 4, COMPACT_COUNT)
    _put64(out + 8, seq)
    _put64(out + 16, <uint64_t>size)
    memcpy(out + COMPACT_HEAD, PyBytes_AS_STRING(body), size)
    return frame


cpdef bytes encode_batch(list bodies, uint64_t seq):
    """``transport.encode_batch``: one frame for several compact messages, delivered in this order."""
    cdef Py_ssize_t count = len(bodies), total = HEADER + 8 * count, index, size
    for body in bodies:
        total += PyBytes_GET_SIZE(<bytes?>body)
    cdef bytes frame = PyBytes_FromStringAndSize(NULL, total)
    cdef char *out = PyBytes_AS_STRING(frame)
    _put32(out, MAGIC)
    _put32(out + 4, <uint32_t>count | INLINE_BIT | COMPACT_BIT | BATCH_BIT)
    _put64(out + 8, seq)
    cdef Py_ssize_t offset = HEADER + 8 * count
    for index in range(count):
        body = bodies[index]
        size = PyBytes_GET_SIZE(body)
        _put64(out + HEADER + 8 * index, <uint64_t>size)
        memcpy(out + offset, PyBytes_AS_STRING(body), size)
        offset += size
    return frame


cpdef object encode(object message, uint64_t seq, Py_ssize_t inline_bytes):
    """``transport.encode``: the frame of a compact message built here, any other message pickled by transport."""
    body = compact_body(message, inline_bytes)
    if body is None:
        return encode_pickled(message, seq, inline_bytes)
    return Encoded(encode_compact(body, seq), [], PyBytes_GET_SIZE(body))


cpdef object decode_frame(object frame):
    """``transport.decode_frame``: a well-formed compact frame (one message or a batch) read here; any other
    frame, and every malformed one, by transport (whose errors are the reference)."""
    cdef Py_buffer view
    cdef const unsigned char *data
    cdef Py_ssize_t length, count, index, offset
    cdef uint32_t magic, flags
    cdef uint64_t seq, size
    cdef list sizes
    PyObject_GetBuffer(frame, &view, PyBUF_SIMPLE)
    try:
        data, length = <const unsigned char *>view.buf, view.len
        if length < COMPACT_HEAD or _get32(data) != MAGIC:
            return transport.decode_frame(frame)
        flags, seq = _get32(data + 4), _get64(data + 8)
        if flags == COMPACT_COUNT:
            size = _get64(data + 16)
            if size != <uint64_t>(length - COMPACT_HEAD):
                return transport.decode_frame(frame)
            return FrameHeader(seq, [size], [frame[COMPACT_HEAD:]], True)
        if flags & (INLINE_BIT | COMPACT_BIT | BATCH_BIT) != (INLINE_BIT | COMPACT_BIT | BATCH_BIT):
            return transport.decode_frame(frame)
        count = flags & ~(INLINE_BIT | COMPACT_BIT | BATCH_BIT)
        offset = HEADER + 8 * count
        if length < offset:
            return transport.decode_frame(frame)
        sizes = []
        for index in range(count):
            size = _get64(data + HEADER + 8 * index)
            if size > <uint64_t>(length - offset):
                return transport.decode_frame(frame)
            sizes.append(size)
            offset += size
        if offset != length:
            return transport.decode_frame(frame)
    finally:
        PyBuffer_Release(&view)
    cdef list parts = []
    offset = HEADER + 8 * count
    for size in sizes:
        parts.append(frame[offset : offset + size])
        offset += size
    return FrameHeader(seq, sizes, parts, True, True)


cdef object _load_compact(object header, object data):
    try:
        return compact_decode(data)
    except NotCompact as error:
        raise TransportError(f"message seq {header.seq}: {error}") from None


cpdef object load(object header, list parts):
    """``transport.load``: the message of a decoded frame, given its parts."""
    if header.compact:
        return _load_compact(header, parts[0])
    return deserialize(parts)


cpdef list load_batch(object header):
    """``transport.load_batch``: the messages of a batch frame, in the order they were sent."""
    return [_load_compact(header, part) for part in header.inline_parts]


# ------------------------------------------------------------------ the frames' MPI calls (wire.Endpoint)
cdef inline int _check(int code) except -1:
    if code != MPI_SUCCESS:
        raise MPI.Exception(code)
    return 0


cdef Request _pending(MPI_Request handle, object buffer):
    cdef Request request = Request.__new__(Request)
    request.ob_mpi = handle
    request.ob_buf = buffer
    return request


cdef class Endpoint:
    """``wire.Endpoint``: frames sent to and matched from the other ranks of one communicator on FRAME_TAG."""

    cdef MPI_Comm comm
    cdef object owner  # the Comm whose handle this is, kept alive with it

    def __cinit__(self, object MPI_module, Comm comm):
        self.comm = comm.ob_mpi
        self.owner = comm

    def send(self, int dest, bytes frame):
        """Start sending ``frame`` to ``dest``: None once it has left, else its pending Request (which holds it)."""
        cdef MPI_Request handle
        cdef int done = 0
        _check(MPI_Isend(PyBytes_AS_STRING(frame), <int>PyBytes_GET_SIZE(frame), MPI_BYTE, dest, FRAME_TAG,
                         self.comm, &handle))
        _check(MPI_Test(&handle, &done, MPI_STATUS_IGNORE))
        return None if done else _pending(handle, frame)

    def match(self):
        """The next frame that has arrived from any rank, as (source, frame, request), the request None when its
        bytes are in ``frame`` already; None when no frame waits."""
        cdef MPI_Message message
        cdef MPI_Status status
        cdef MPI_Request handle
        cdef int found = 0, count = 0, done = 0
        _check(MPI_Improbe(MPI_ANY_SOURCE, FRAME_TAG, self.comm, &found, &message, &status))
        if not found:
            return None
        _check(MPI_Get_count(&status, MPI_BYTE, &count))
        frame = PyByteArray_FromStringAndSize(NULL, count)
        _check(MPI_Imrecv(PyByteArray_AS_STRING(frame), count, MPI_BYTE, &message, &handle))
        _check(MPI_Test(&handle, &done, MPI_STATUS_IGNORE))
        return status.MPI_SOURCE, memoryview(frame), None if done else _pending(handle, frame)
