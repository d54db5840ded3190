# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The message path compiled: the frame header, the compact codec and the frames' MPI calls.

Each function here has a pure-Python twin that is the reference the tests hold it to, bit for bit on the wire:
``compact.encode``/``decode``, ``transport.compact_body``/``encode_compact``/``encode_batch``/``encode``/
``load``/``load_batch`` and ``wire.Endpoint``; a frame it does not read where it arrives (a pickled one, a
compact one queued behind others from its source, a malformed one) is read by ``transport.decode_frame``.
``wire`` picks this module where it is built and current, the twins elsewhere (``launch/setup.sh`` builds it;
``MPISCALE_PURE_PYTHON=1`` forces the twins).

What makes it faster than the same Python compiled: the checks of a message's values are C type comparisons,
the header is written and read as bytes in C, marshal is called through its C API, and the frames' MPI calls go
straight to the MPI library (mpi4py's ``libmpi.pxd``), with no Python object per call but the frame itself.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_FromStringAndSize
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.limits cimport INT_MAX
from libc.stdint cimport uint32_t, uint64_t
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.string cimport memcpy
from mpi4py.libmpi cimport (
    MPI_ANY_SOURCE, MPI_BYTE, MPI_Comm, MPI_Get_count, MPI_Improbe, MPI_Imrecv, MPI_Isend, MPI_Message,
    MPI_Request, MPI_Status, MPI_STATUS_IGNORE, MPI_SUCCESS, MPI_Test,
)
from mpi4py.MPI cimport Comm, Request

cimport numpy as cnp
from cpython.ref cimport Py_INCREF

from mpi4py import MPI

from . import compact, compact_check, transport

cnp.import_array()

cdef extern from "numpy/arrayobject.h":
    object PyArray_Empty(int nd, cnp.npy_intp *dims, cnp.dtype descr, int fortran)  # steals descr

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
cdef object _rebuild = compact._rebuild
cdef object dtype_from_code = compact.dtype_from_code
cdef object plain_dtype_code = compact.plain_dtype_code
cdef object NotCompact = compact.NotCompact
cdef object TransportError = transport.TransportError
cdef object Encoded = transport.Encoded
cdef object encode_pickled = transport.encode_pickled
cdef object deserialize = transport.deserialize


# ------------------------------------------------------------------ the compact codec (compact.py)
cdef dict _codes = {}  # dtype -> its code (compact.plain_dtype_code), None where it is not plain
cdef dict _plain = {}  # code -> its dtype where an array of it is built here, None where the reference builds it
cdef Py_ssize_t _MAX_DIMS = 32
cdef long long _MAX_EXTENT = 1LL << 40


cdef object _array_entry(cnp.ndarray array):
    """``compact._array_entry``: (code, shape, bytes), or None where the array does not travel compact."""
    dtype = <object>cnp.PyArray_DESCR(array)
    code = _codes.get(dtype, False)
    if code is False:
        code = _codes[dtype] = plain_dtype_code(dtype)
    cdef Py_ssize_t size = cnp.PyArray_NBYTES(array)
    if code is None or size > MAX_ARRAY_BYTES or not cnp.PyArray_IS_C_CONTIGUOUS(array):
        return None
    return (code, (<object>array).shape, PyBytes_FromStringAndSize(<char *>cnp.PyArray_DATA(array), size))


cdef object _plain_dtype(str code):
    dtype = _plain.get(code, False)
    if dtype is False:
        try:
            dtype = dtype_from_code(code)
        except Exception:  # the reference raises its own error for it
            dtype = None
        if dtype is not None and (dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None
                                  or dtype.itemsize == 0):
            dtype = None
        if len(_plain) < 256:  # codes come from the wire: keep what a damaged frame can add bounded
            _plain[code] = dtype
    return dtype


cdef object _array(object entry):
    """``compact._rebuild`` of a well-formed entry of a plain dtype, built here; any other by the reference."""
    cdef cnp.npy_intp dims[32]
    cdef Py_ssize_t dimension, count
    cdef long long extent, elements = 1
    if type(entry) is not tuple or len(<tuple>entry) != 3:
        return _rebuild(entry)
    code, shape, data = <tuple>entry
    if type(code) is not str or type(shape) is not tuple or type(data) is not bytes:
        return _rebuild(entry)
    count = len(<tuple>shape)
    dtype = _plain_dtype(<str>code) if count <= _MAX_DIMS else None
    if dtype is None:
        return _rebuild(entry)
    for dimension in range(count):
        size = (<tuple>shape)[dimension]
        if type(size) is not int or not 0 <= size <= _MAX_EXTENT:
            return _rebuild(entry)
        extent = size
        dims[dimension] = <cnp.npy_intp>extent
        elements *= extent
        if elements > _MAX_EXTENT:
            return _rebuild(entry)
    if elements * dtype.itemsize != PyBytes_GET_SIZE(data):
        return _rebuild(entry)
    Py_INCREF(dtype)
    array = PyArray_Empty(<int>count, dims, <cnp.dtype>dtype, 0)
    memcpy(cnp.PyArray_DATA(<cnp.ndarray>array), PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data))
    return array


cdef tuple _with_arrays(tuple body, tuple positions):
    """``compact.with_arrays``: ``body`` with the array entries at ``positions`` rebuilt into arrays."""
    cdef list items = list(body)
    cdef Py_ssize_t outer, inner, count = len(items)
    cdef long long place
    for position in positions:
        outer, inner = -1, 0
        if type(position) is int and -(1 << 62) < position < (1 << 62):
            place = position
            outer, inner = <Py_ssize_t>(place >> 16), <Py_ssize_t>(place & 0xFFFF)
        if not 0 <= outer < count:
            raise NotCompact(f"not a compact message: array position {position!r} is outside the message")
        if inner == 0:
            items[outer] = _array(items[outer])
        else:
            values = items[outer]
            if type(values) is not tuple or inner > len(<tuple>values):
                raise NotCompact(f"not a compact message: array position {position!r} is outside the message")
            values = list(values)
            values[inner - 1] = _array(values[inner - 1])
            items[outer] = tuple(values)
    return tuple(items)


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


cdef tuple _decode_at(const unsigned char *data, Py_ssize_t length):
    """``compact.decode`` of the ``length`` bytes at ``data``: checked, loaded by marshal, arrays rebuilt."""
    cdef Py_ssize_t count = 0, end
    cdef char *refs = <char *>PyMem_Malloc(length + 1)  # each reference takes a byte of the data at least
    if refs == NULL:
        raise MemoryError()
    try:
        end = _object(data, length, 0, refs, &count, 0)
        if end != length:
            _fail(f"{length - end} bytes after the marshal data")
        try:
            loaded = PyMarshal_ReadObjectFromString(<const char *>data, length)
        except (ValueError, EOFError, TypeError) as error:
            raise NotCompact(f"not a compact message: {error}") from None
    finally:
        PyMem_Free(refs)
    if type(loaded) is not tuple or len(<tuple>loaded) != 2:
        raise NotCompact("not a compact message: wrong structure")
    body, positions = <tuple>loaded
    if type(body) is not tuple or type(positions) is not tuple:
        raise NotCompact("not a compact message: wrong structure")
    return _with_arrays(<tuple>body, <tuple>positions) if positions else body


cpdef tuple compact_decode(object data):
    """``compact.decode``: the message whose compact bytes are ``data``; NotCompact if they are not well formed."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise NotCompact(f"not a compact message: {type(data).__name__} is not bytes")
    cdef Py_buffer view
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        return _decode_at(<const unsigned char *>view.buf, view.len)
    finally:
        PyBuffer_Release(&view)


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


cdef enum Layout:
    OTHER = 0  # not a compact frame, or a malformed one: the reference reads it
    SINGLE = 1  # one compact message after the header and its size
    BATCH = 2  # a batch whose sizes add up to the frame


cdef Layout _layout(const unsigned char *data, Py_ssize_t length, uint64_t *seq, Py_ssize_t *count) noexcept:
    """What a frame holds, read from its header and size table (``seq`` and ``count`` set for the compact ones)."""
    cdef uint32_t flags
    cdef Py_ssize_t index, offset
    cdef uint64_t size
    if length < COMPACT_HEAD or _get32(data) != MAGIC:
        return OTHER
    flags, seq[0] = _get32(data + 4), _get64(data + 8)
    if flags == COMPACT_COUNT:
        count[0] = 1
        return SINGLE if _get64(data + 16) == <uint64_t>(length - COMPACT_HEAD) else OTHER
    if flags & (INLINE_BIT | COMPACT_BIT | BATCH_BIT) != (INLINE_BIT | COMPACT_BIT | BATCH_BIT):
        return OTHER
    count[0] = flags & ~(INLINE_BIT | COMPACT_BIT | BATCH_BIT)
    offset = HEADER + 8 * count[0]
    if length < offset:
        return OTHER
    for index in range(count[0]):
        size = _get64(data + HEADER + 8 * index)
        if size > <uint64_t>(length - offset):
            return OTHER
        offset += size
    return BATCH if offset == length else OTHER


cdef object _message_at(uint64_t seq, const unsigned char *data, Py_ssize_t length):
    try:
        return _decode_at(data, length)
    except NotCompact as error:
        raise TransportError(f"message seq {seq}: {error}") from None


cpdef object compact_messages(object frame):
    """The messages of a well-formed compact frame (one message, or a batch), read in place; None for any other
    frame (the caller reads it with ``transport.decode_frame``, whose errors are the reference)."""
    cdef Py_buffer view
    cdef const unsigned char *data
    cdef Py_ssize_t count = 0, index, offset
    cdef uint64_t seq = 0, size
    cdef Layout layout
    cdef list messages = []
    PyObject_GetBuffer(frame, &view, PyBUF_SIMPLE)
    try:
        data = <const unsigned char *>view.buf
        layout = _layout(data, view.len, &seq, &count)
        if layout == OTHER:
            return None
        if layout == SINGLE:
            return [_message_at(seq, data + COMPACT_HEAD, view.len - COMPACT_HEAD)]
        offset = HEADER + 8 * count
        for index in range(count):
            size = _get64(data + HEADER + 8 * index)
            messages.append(_message_at(seq, data + offset, size))
            offset += size
        return messages
    finally:
        PyBuffer_Release(&view)


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
        if PyBytes_GET_SIZE(frame) > INT_MAX:  # MPI-3 counts are ints (mpi4py's own check, in the reference)
            raise OverflowError(f"a frame of {PyBytes_GET_SIZE(frame)} bytes is over MPI's count limit")
        _check(MPI_Isend(PyBytes_AS_STRING(frame), <int>PyBytes_GET_SIZE(frame), MPI_BYTE, dest, FRAME_TAG,
                         self.comm, &handle))
        _check(MPI_Test(&handle, &done, MPI_STATUS_IGNORE))
        return None if done else _pending(handle, frame)

    def send_array(self, int dest, int header_tag, int data_tag, tuple fields, cnp.ndarray array, bint inline):
        """``wire.Endpoint.send_array``: a channel's header (``fields``, the number of dimensions, the shape, as
        int64 words) and then ``array``'s bytes to ``dest``, in the header's message when ``inline``; the requests
        still pending (each holds its buffer)."""
        cdef Py_ssize_t nfields = len(fields), ndim = cnp.PyArray_NDIM(array), index, nbytes = cnp.PyArray_NBYTES(array)
        cdef cnp.npy_intp *shape = cnp.PyArray_DIMS(array)
        cdef MPI_Request handle
        cdef int done = 0
        cdef long long *words
        if not cnp.PyArray_IS_C_CONTIGUOUS(array) or nbytes > INT_MAX:
            raise ValueError("send_array takes a C-contiguous array of at most MPI's int count of bytes")
        cdef Py_ssize_t head = 8 * (nfields + 1 + ndim), size = head + (nbytes if inline else 0)
        header = PyBytes_FromStringAndSize(NULL, size)
        words = <long long *>PyBytes_AS_STRING(header)
        for index in range(nfields):
            words[index] = fields[index]
        words[nfields] = ndim
        for index in range(ndim):
            words[nfields + 1 + index] = shape[index]
        if inline:
            memcpy(PyBytes_AS_STRING(header) + head, cnp.PyArray_DATA(array), nbytes)
        pending = []
        _check(MPI_Isend(words, <int>size, MPI_BYTE, dest, header_tag, self.comm, &handle))
        _check(MPI_Test(&handle, &done, MPI_STATUS_IGNORE))
        if not done:
            pending.append(_pending(handle, header))
        if inline:
            return pending
        _check(MPI_Isend(cnp.PyArray_DATA(array), <int>nbytes, MPI_BYTE, dest, data_tag, self.comm, &handle))
        _check(MPI_Test(&handle, &done, MPI_STATUS_IGNORE))
        if not done:
            pending.append(_pending(handle, array))
        return pending

    def receive(self, dict inbound):
        """``wire.Endpoint.receive``: the next frame that has arrived, as (source, messages, frame bytes) where it is
        a complete compact frame (one message or a batch) and nothing from its source waits before it (``inbound``:
        the engine's queues by source); any other frame as :meth:`match` gives it; None when no frame waits."""
        found = self.match()
        if found is None:
            return None
        source, frame, request = <tuple>found
        if request is not None or inbound.get(source):
            return found
        messages = compact_messages(frame)
        return found if messages is None else (source, messages, len(frame))

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
