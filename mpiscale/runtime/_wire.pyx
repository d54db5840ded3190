# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The message path compiled: the frame header, the compact codec, the frames' MPI calls, the send queue, the
routing of arrived envelopes, a channel's two ends, and the messages of a two-rank allreduce.

Each function here has a pure-Python twin that is the reference the tests hold it to, bit for bit on the wire:
``compact.encode``/``decode``, ``transport.compact_body``/``encode_compact``/``encode_batch``/``load``/
``load_batch``, ``wire.Endpoint``, ``outbox.Outbox``, ``dispatch.Dispatch``, ``channel_send.Sender``,
``channel_receive.Receiver`` and ``pair_reduce.PairExchange``; a frame it does not read where
it arrives (a pickled one, a compact one queued behind others from its source, a malformed one) is read by
``transport.decode_frame``.
``wire`` picks this module where it is built and current, the twins elsewhere (``launch/setup.sh`` builds it;
``MPISCALE_PURE_PYTHON=1`` forces the twins).

What makes it faster than the same Python compiled: the checks of a message's values are C type comparisons,
the header and the compact format are written and read as bytes in C, and the frames' MPI calls go
straight to the MPI library (mpi4py's ``libmpi.pxd``), with no Python object per call but the frame itself.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_FromStringAndSize
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.limits cimport INT_MAX
from libc.stdint cimport uint32_t, uint64_t
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from libc.string cimport memcpy
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec
from mpi4py.libmpi cimport (
    MPI_ANY_SOURCE, MPI_BYTE, MPI_Comm, MPI_Datatype, MPI_Get_count, MPI_Iallgather, MPI_Improbe, MPI_Imrecv,
    MPI_Irecv, MPI_Isend, MPI_Message, MPI_Request, MPI_Status, MPI_STATUS_IGNORE, MPI_STATUSES_IGNORE, MPI_SUCCESS,
    MPI_Test, MPI_Testall, MPI_Testsome, MPI_UNDEFINED,
)
from mpi4py.MPI cimport Comm, Datatype, Request

cimport numpy as cnp
from cpython.ref cimport PyObject, Py_INCREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM

import asyncio as _asyncio

from mpi4py import MPI

from . import actor as _actor, channel_format as _channel_format, channel_receive as _channel_receive
from . import channel_send as _channel_send, compact, dispatch as _dispatch, errors as _errors, outbox as _outbox
from . import pair_reduce as _pair_reduce, transport

cnp.import_array()

cdef extern from "numpy/arrayobject.h":
    object PyArray_Empty(int nd, cnp.npy_intp *dims, cnp.dtype descr, int fortran)  # steals descr
    object PyArray_NewFromDescr(type subtype, cnp.dtype descr, int nd, cnp.npy_intp *dims, cnp.npy_intp *strides,
                                void *data, int flags, object obj)  # steals descr

cdef extern from "Python.h":
    const char *PyUnicode_AsUTF8AndSize(object text, Py_ssize_t *size) except NULL
    object PyUnicode_DecodeUTF8(const char *data, Py_ssize_t size, const char *errors)
    long long PyLong_AsLongLongAndOverflow(object number, int *overflow) except? -1
    double PyFloat_AS_DOUBLE(object number)
    PyObject *PyList_GET_ITEM_BORROWED "PyList_GET_ITEM" (object items, Py_ssize_t index)
    Py_ssize_t Py_REFCNT_OF "Py_REFCNT" (PyObject *item)

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
cdef object plain_dtype_code = compact.plain_dtype_code
cdef object NotCompact = compact.NotCompact
cdef object TransportError = transport.TransportError
cdef object MessageRefused = _errors.MessageRefused
cdef object deserialize = transport.deserialize


# ------------------------------------------------------------------ bytes, little-endian
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



# ------------------------------------------------------------------ the compact codec (compact.py)
cdef Py_ssize_t _MAX_DIMS = compact.MAX_DIMS
cdef long long _MAX_EXTENT = compact.MAX_EXTENT
cdef long long _U32_MAX = 0xFFFFFFFF
cdef dict _codes = {}  # dtype -> the ASCII bytes of its code, None where its arrays are not compact
cdef dict _dtypes = {}  # code bytes -> compact.array_dtype of them (at most 256 kept: codes come from the wire)
cdef object array_dtype = compact.array_dtype


cdef struct _Out:
    char *data
    Py_ssize_t size
    Py_ssize_t capacity


cdef int _room(_Out *out, Py_ssize_t count) except -1:
    cdef Py_ssize_t capacity = out.capacity
    cdef char *data
    if out.size + count <= capacity:
        return 0
    while capacity < out.size + count:
        capacity *= 2
    data = <char *>PyMem_Realloc(out.data, capacity)
    if data == NULL:
        raise MemoryError()
    out.data, out.capacity = data, capacity
    return 0


cdef inline int _put_tag(_Out *out, char tag) except -1:
    _room(out, 1)
    out.data[out.size] = tag
    out.size += 1
    return 0


cdef inline int _put_count(_Out *out, char tag, Py_ssize_t count) except -1:
    _room(out, 5)
    out.data[out.size] = tag
    _put32(out.data + out.size + 1, <uint32_t>count)
    out.size += 5
    return 0


cdef inline int _put_data(_Out *out, const void *data, Py_ssize_t count) except -1:
    _room(out, count)
    memcpy(out.data + out.size, data, count)
    out.size += count
    return 0


cdef bint _scalar(_Out *out, object value) except -1:
    """``compact._scalar``: write ``value`` if it is a scalar; whether it was."""
    cdef type kind = type(value)
    cdef int overflow = 0
    cdef long long number
    cdef double real
    cdef uint64_t bits
    cdef Py_ssize_t size
    cdef const char *text
    if value is None:
        _put_tag(out, b'N')
    elif kind is bool:
        _put_tag(out, b'T' if value else b'F')
    elif kind is int:
        number = PyLong_AsLongLongAndOverflow(value, &overflow)
        if overflow == 0:
            _put_tag(out, b'i')
            _room(out, 8)
            _put64(out.data + out.size, <uint64_t>number)
            out.size += 8
        else:
            data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
            if PyBytes_GET_SIZE(data) > _U32_MAX:
                return False
            _put_count(out, b'I', PyBytes_GET_SIZE(data))
            _put_data(out, PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data))
    elif kind is float:
        real = PyFloat_AS_DOUBLE(value)
        memcpy(&bits, &real, 8)
        _put_tag(out, b'd')
        _room(out, 8)
        _put64(out.data + out.size, bits)  # little-endian, as the reference's "<d"
        out.size += 8
    elif kind is str:
        try:
            text = PyUnicode_AsUTF8AndSize(value, &size)
        except UnicodeEncodeError:  # lone surrogates, which marshal and pickle carry too
            data = (<str>value).encode("utf-8", "surrogatepass")
            text, size = PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data)
        if size > _U32_MAX:
            return False
        _put_count(out, b's', size)
        _put_data(out, text, size)
    elif kind is bytes:
        if PyBytes_GET_SIZE(value) > _U32_MAX:
            return False
        _put_count(out, b'b', PyBytes_GET_SIZE(value))
        _put_data(out, PyBytes_AS_STRING(value), PyBytes_GET_SIZE(value))
    else:
        return False
    return True


cdef bint _array(_Out *out, cnp.ndarray array) except -1:
    """``compact._array``: write ``array`` if it travels compact; whether it does."""
    dtype = <object>cnp.PyArray_DESCR(array)
    code = _codes.get(dtype, False)
    if code is False:
        plain = plain_dtype_code(dtype)
        code = _codes[dtype] = None if plain is None or dtype.itemsize == 0 else plain.encode("ascii")
    cdef Py_ssize_t nbytes = cnp.PyArray_NBYTES(array), ndim = cnp.PyArray_NDIM(array), index
    if code is None or nbytes > MAX_ARRAY_BYTES or ndim > _MAX_DIMS or not cnp.PyArray_IS_C_CONTIGUOUS(array):
        return False
    cdef cnp.npy_intp *shape = cnp.PyArray_DIMS(array)
    _put_tag(out, b'a')
    _put_tag(out, <char>PyBytes_GET_SIZE(code))
    _put_data(out, PyBytes_AS_STRING(code), PyBytes_GET_SIZE(code))
    _put_tag(out, <char>ndim)
    _room(out, 8 * ndim + nbytes)
    for index in range(ndim):
        _put64(out.data + out.size, <uint64_t>shape[index])
        out.size += 8
    _put_data(out, cnp.PyArray_DATA(array), nbytes)
    return True


cdef inline bint _value(_Out *out, object value) except -1:
    if type(value) is _ndarray:
        return _array(out, <cnp.ndarray>value)
    return _scalar(out, value)


cdef bint _message(_Out *out, tuple message) except -1:
    """``compact.encode``'s walk: write ``message``; whether it qualifies."""
    cdef type kind
    _put_count(out, b't', len(message))
    for item in message:
        kind = type(item)
        if kind is tuple:
            _put_count(out, b't', len(<tuple>item))
            for value in <tuple>item:
                if not _value(out, value):
                    return False
        elif kind is dict:
            _put_count(out, b'm', len(<dict>item))
            for key, value in (<dict>item).items():
                if type(key) is not str or not _scalar(out, key) or not _scalar(out, value):
                    return False
        elif not _value(out, item):
            return False
    return True


cpdef object compact_encode(object message):
    """``compact.encode``: the compact bytes of ``message``, or None when it does not qualify."""
    if type(message) is not tuple:
        return None
    cdef _Out out
    out.size, out.capacity = 0, 256
    out.data = <char *>PyMem_Malloc(out.capacity)
    if out.data == NULL:
        raise MemoryError()
    try:
        if not _message(&out, <tuple>message):
            return None
        return PyBytes_FromStringAndSize(out.data, out.size)
    finally:
        PyMem_Free(out.data)


cdef struct _In:
    const unsigned char *data
    Py_ssize_t length
    Py_ssize_t at


cdef int _fail(str why) except -1:
    raise NotCompact(f"not a compact message: {why}")


cdef inline Py_ssize_t _take(_In *source, Py_ssize_t count) except -1:
    """``compact._Reader.take``: the offset of the next ``count`` bytes, which the cursor passes."""
    cdef Py_ssize_t start = source.at
    if count > source.length - start:
        _fail(f"it ends early at byte {start}")
    source.at = start + count
    return start


cdef inline int _tag(_In *source) except -1:
    return source.data[_take(source, 1)]


cdef inline long long _u32(_In *source) except -1:
    return _get32(source.data + _take(source, 4))


cdef inline long long _i64(_In *source) except? -1:
    return <long long>_get64(source.data + _take(source, 8))


cdef int _unexpected(_In *source, int tag) except -1:
    _fail(f"byte {source.at - 1} ({tag:#04x}) is not what a compact message holds there")


cdef object _decoded_value(_In *source, bint arrays):
    """``compact._Reader.value``."""
    cdef int tag = _tag(source)
    cdef Py_ssize_t size, start
    cdef double real
    cdef uint64_t bits
    if tag == b'N':
        return None
    if tag == b'T' or tag == b'F':
        return tag == b'T'
    if tag == b'i':
        return _i64(source)
    if tag == b'd':
        bits = _get64(source.data + _take(source, 8))
        memcpy(&real, &bits, 8)
        return real
    if tag == b'I' or tag == b's' or tag == b'b':
        size = _u32(source)
        start = _take(source, size)
        if tag == b's':
            try:
                return PyUnicode_DecodeUTF8(<const char *>source.data + start, size, "surrogatepass")
            except UnicodeDecodeError:
                _fail(f"the text at byte {start} is not UTF-8")
        data = PyBytes_FromStringAndSize(<const char *>source.data + start, size)
        return data if tag == b'b' else int.from_bytes(data, "little", signed=True)
    if tag == b'a' and arrays:
        return _decoded_array(source, source.at - 1)
    _unexpected(source, tag)


cdef object _decoded_array(_In *source, Py_ssize_t start):
    """``compact._Reader.array``: the array whose entry begins at ``start``."""
    cdef cnp.npy_intp dims[32]
    cdef Py_ssize_t size = _tag(source), ndim, dimension, offset, itemsize
    cdef long long extent, elements = 1
    offset = _take(source, size)
    code = PyBytes_FromStringAndSize(<const char *>source.data + offset, size)
    dtype = _dtypes.get(code, False)
    if dtype is False:
        dtype = array_dtype(code)
        if len(_dtypes) < 256:
            _dtypes[code] = dtype
    if dtype is None:
        _fail(f"the array at byte {start} has dtype code {code!r}, not a plain dtype's")
    ndim = _tag(source)
    if ndim > _MAX_DIMS:
        _fail(f"the array at byte {start} has {ndim} dimensions, over {_MAX_DIMS}")
    for dimension in range(ndim):
        extent = _i64(source)
        if not 0 <= extent <= _MAX_EXTENT or (extent != 0 and elements > _MAX_EXTENT // extent):
            _fail(f"the array at byte {start} has an extent of {extent}")
        elements *= extent
        dims[dimension] = <cnp.npy_intp>extent
    itemsize = (<cnp.dtype>dtype).itemsize
    if elements > (source.length - source.at) // itemsize:
        _fail(f"it ends early at byte {source.at}")
    offset = _take(source, elements * itemsize)
    Py_INCREF(dtype)
    array = PyArray_Empty(<int>ndim, dims, <cnp.dtype>dtype, 0)
    memcpy(cnp.PyArray_DATA(<cnp.ndarray>array), source.data + offset, elements * itemsize)
    return array


cdef object _decoded_item(_In *source):
    """An item of a message: a tuple of values, a dict of scalars, or a value."""
    cdef Py_ssize_t count, entry
    cdef int tag = _tag(source)
    if tag == b't':
        return _decoded_tuple(source, _u32(source), False)
    if tag == b'm':
        entries = {}
        count = _u32(source)
        for entry in range(count):
            tag = _tag(source)
            if tag != b's':
                _unexpected(source, tag)
            source.at -= 1
            key = _decoded_value(source, False)
            entries[key] = _decoded_value(source, False)
        return entries
    source.at -= 1
    return _decoded_value(source, True)


cdef tuple _decoded_tuple(_In *source, Py_ssize_t count, bint message):
    """The next ``count`` items of a message (``message``) or values of a tuple in it, as a tuple."""
    cdef Py_ssize_t index
    if count > source.length - source.at:  # each takes a byte at least: reading them fails, as in the reference
        for index in range(count):
            _decoded_item(source) if message else _decoded_value(source, True)
    values = PyTuple_New(count)
    for index in range(count):
        value = _decoded_item(source) if message else _decoded_value(source, True)
        Py_INCREF(value)
        PyTuple_SET_ITEM(values, index, value)
    return values


cdef tuple _decode_at(const unsigned char *data, Py_ssize_t length):
    """``compact.decode`` of the ``length`` bytes at ``data``."""
    cdef _In source
    source.data, source.length, source.at = data, length, 0
    cdef int tag = _tag(&source)
    if tag != b't':
        _unexpected(&source, tag)
    message = _decoded_tuple(&source, _u32(&source), True)
    if source.at != length:
        _fail(f"{length - source.at} bytes follow the message")
    return message


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
    cdef Py_ssize_t count = 0
    cdef uint64_t seq = 0
    cdef Layout layout
    PyObject_GetBuffer(frame, &view, PyBUF_SIMPLE)
    try:
        data = <const unsigned char *>view.buf
        layout = _layout(data, view.len, &seq, &count)
        return None if layout == OTHER else _messages_at(data, view.len, layout, seq, count)
    finally:
        PyBuffer_Release(&view)


cdef list _messages_at(const unsigned char *data, Py_ssize_t length, Layout layout, uint64_t seq, Py_ssize_t count):
    """The messages of a compact frame whose ``_layout`` is SINGLE or BATCH (``seq``, ``count``: as it read them)."""
    cdef Py_ssize_t index, offset
    cdef uint64_t size
    if layout == SINGLE:
        return [_message_at(seq, data + COMPACT_HEAD, length - COMPACT_HEAD)]
    cdef list messages = []
    offset = HEADER + 8 * count
    for index in range(count):
        size = _get64(data + HEADER + 8 * index)
        messages.append(_message_at(seq, data + offset, size))
        offset += size
    return messages


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


cdef enum:
    _CH_FIELDS = 8  # a channel header's words before the shape: magic, lane, mode, bytes, key (3), dtype code


cdef list _send_array(MPI_Comm comm, int dest, int header_tag, int data_tag, const long long *fields,
                      Py_ssize_t nfields, cnp.ndarray array, bint inline):
    """A channel's header (``fields``, the number of dimensions, the shape) and ``array``'s bytes to ``dest``, in
    the header's message when ``inline``; the requests still pending (each holds its buffer)."""
    cdef Py_ssize_t ndim = cnp.PyArray_NDIM(array), index, nbytes = cnp.PyArray_NBYTES(array)
    cdef cnp.npy_intp *shape = cnp.PyArray_DIMS(array)
    cdef MPI_Request handle
    cdef int done = 0
    cdef long long *words
    if not cnp.PyArray_IS_C_CONTIGUOUS(array) or nbytes > INT_MAX:
        raise ValueError("send_array takes a C-contiguous array of at most MPI's int count of bytes")
    cdef Py_ssize_t head = 8 * (nfields + 1 + ndim), size = head + (nbytes if inline else 0)
    header = PyBytes_FromStringAndSize(NULL, size)
    words = <long long *>PyBytes_AS_STRING(header)
    memcpy(words, fields, 8 * nfields)
    words[nfields] = ndim
    for index in range(ndim):
        words[nfields + 1 + index] = shape[index]
    if inline:
        memcpy(PyBytes_AS_STRING(header) + head, cnp.PyArray_DATA(array), nbytes)
    pending = []
    _check(MPI_Isend(words, <int>size, MPI_BYTE, dest, header_tag, comm, &handle))
    _check(MPI_Test(&handle, &done, MPI_STATUS_IGNORE))
    if not done:
        pending.append(_pending(handle, header))
    if inline:
        return pending
    _check(MPI_Isend(cnp.PyArray_DATA(array), <int>nbytes, MPI_BYTE, dest, data_tag, comm, &handle))
    _check(MPI_Test(&handle, &done, MPI_STATUS_IGNORE))
    if not done:
        pending.append(_pending(handle, array))
    return pending


cdef enum:
    _ON_STACK = 32  # requests tested with arrays on the stack; more take memory of their own


def testsome(object MPI_module, list pending):
    """``wire.testsome``: the indices of the requests of ``pending`` (each item's ``request``) that completed, in
    one ``MPI_Testsome``; None when every request is null."""
    return _testsome(pending)


cdef object _testsome(list pending):
    """``testsome``, called from C."""
    cdef Py_ssize_t count = len(pending), index
    cdef MPI_Request stack_handles[_ON_STACK]
    cdef int stack_indices[_ON_STACK]
    cdef MPI_Request *handles = stack_handles
    cdef int *indices = stack_indices
    cdef int done = 0, code
    cdef list requests = [item.request for item in pending]
    if count > INT_MAX:
        raise OverflowError(f"{count} requests at once are over MPI's count limit")
    if count > _ON_STACK:
        handles = <MPI_Request *>PyMem_Malloc(count * sizeof(MPI_Request))
        indices = <int *>PyMem_Malloc(count * sizeof(int))
        if handles == NULL or indices == NULL:
            PyMem_Free(handles)
            PyMem_Free(indices)
            raise MemoryError()
    try:
        for index in range(count):
            handles[index] = (<Request?>requests[index]).ob_mpi
        code = MPI_Testsome(<int>count, handles, &done, indices, MPI_STATUSES_IGNORE)
        for index in range(count):  # also on an error: MPI freed the requests it completed
            (<Request>requests[index]).ob_mpi = handles[index]
        _check(code)
        if done == MPI_UNDEFINED:
            return None
        return [indices[index] for index in range(done)]
    finally:
        if count > _ON_STACK:
            PyMem_Free(handles)
            PyMem_Free(indices)


cdef enum:
    _SCRATCH_BYTES = 4096  # frames up to this size are received into the endpoint's scratch buffer


cdef class Dispatch


cdef class Endpoint:
    """``wire.Endpoint``: frames sent to and matched from the other ranks of one communicator on FRAME_TAG."""

    cdef MPI_Comm comm
    cdef object owner  # the Comm whose handle this is, kept alive with it
    cdef bytearray scratch  # where small frames land to be read in place

    def __cinit__(self, object MPI_module, Comm comm):
        self.comm = comm.ob_mpi
        self.owner = comm
        self.scratch = PyByteArray_FromStringAndSize(NULL, _SCRATCH_BYTES)

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
        cdef long long words[_CH_FIELDS]
        cdef Py_ssize_t index, nfields = len(fields)
        if nfields > _CH_FIELDS:
            raise ValueError(f"a channel header has at most {_CH_FIELDS} fields before the shape, got {nfields}")
        for index in range(nfields):
            words[index] = fields[index]
        return _send_array(self.comm, dest, header_tag, data_tag, words, nfields, array, inline)

    cpdef object drain(self, dict inbound, object deliver, object counts):
        """``wire.Endpoint.drain``: deliver each complete compact frame that has arrived, read in place; the first
        other frame as :meth:`match` gives it; else whether it delivered any."""
        cdef MPI_Message message
        cdef MPI_Status status
        cdef MPI_Request handle
        cdef int found = 0, count = 0, done = 0
        cdef Py_ssize_t nmessages = 0
        cdef uint64_t seq = 0
        cdef Layout layout
        cdef bint delivered = False
        cdef const unsigned char *data
        cdef tuple other
        while True:
            _check(MPI_Improbe(MPI_ANY_SOURCE, FRAME_TAG, self.comm, &found, &message, &status))
            if not found:
                return delivered
            _check(MPI_Get_count(&status, MPI_BYTE, &count))
            source = status.MPI_SOURCE
            if inbound.get(source):
                return self._received(&message, count, source)
            if count > _SCRATCH_BYTES:
                other = self._received(&message, count, source)
                if other[2] is not None:
                    return other
                frame = other[1]
                data = <const unsigned char *>PyByteArray_AS_STRING(frame.obj)
            else:
                frame = self.scratch
                data = <const unsigned char *>PyByteArray_AS_STRING(frame)
                _check(MPI_Imrecv(<void *>data, count, MPI_BYTE, &message, &handle))
                _check(MPI_Test(&handle, &done, MPI_STATUS_IGNORE))
                if not done:  # the frame's bytes still come into the scratch buffer, which it keeps
                    self.scratch = PyByteArray_FromStringAndSize(NULL, _SCRATCH_BYTES)
                    return source, memoryview(frame)[:count], _pending(handle, frame)
                other = None
            layout = _layout(data, count, &seq, &nmessages)
            if layout == OTHER:
                if other is None:
                    other = source, memoryview(PyByteArray_FromStringAndSize(<const char *>data, count)), None
                return other
            try:
                messages = _messages_at(data, count, layout, seq, nmessages)
                counts.bytes_received += count
                counts.messages_received += nmessages
                if type(deliver) is Dispatch:
                    (<Dispatch>deliver).envelopes(source, messages)
                else:
                    deliver.envelopes(source, messages)
            except Exception as error:
                raise MessageRefused.of(source, error) from error
            delivered = True

    cdef tuple _received(self, MPI_Message *message, int count, object source):
        """``match``'s answer for a frame already probed (``message``, of ``count`` bytes)."""
        cdef MPI_Request handle
        cdef int done = 0
        frame = PyByteArray_FromStringAndSize(NULL, count)
        _check(MPI_Imrecv(PyByteArray_AS_STRING(frame), count, MPI_BYTE, message, &handle))
        _check(MPI_Test(&handle, &done, MPI_STATUS_IGNORE))
        return source, memoryview(frame), None if done else _pending(handle, frame)

    def match(self):
        """The next frame that has arrived from any rank, as (source, frame, request), the request None when its
        bytes are in ``frame`` already; None when no frame waits."""
        cdef MPI_Message message
        cdef MPI_Status status
        cdef int found = 0, count = 0
        _check(MPI_Improbe(MPI_ANY_SOURCE, FRAME_TAG, self.comm, &found, &message, &status))
        if not found:
            return None
        _check(MPI_Get_count(&status, MPI_BYTE, &count))
        return self._received(&message, count, status.MPI_SOURCE)


cdef extern from "<sched.h>" nogil:
    int sched_yield()


cdef class Poller:
    """``polling.Poller``: the same poll, and the same spins on it, with no Python call per poll."""

    cdef Endpoint endpoint
    cdef dict inbound
    cdef object envelopes, counts, frames_found, match_parts, pending_done
    cdef list pending, unmatched, pollers

    def __init__(self, Endpoint endpoint, dict inbound, object envelopes, object counts, list pending, list unmatched,
                 list pollers, object frames_found, object match_parts, object pending_done):
        self.endpoint, self.inbound, self.envelopes, self.counts = endpoint, inbound, envelopes, counts
        self.pending, self.unmatched, self.pollers = pending, unmatched, pollers
        self.frames_found, self.match_parts, self.pending_done = frames_found, match_parts, pending_done

    cpdef bint poll(self) except -1:
        """``polling.Poller.poll``."""
        found = self.endpoint.drain(self.inbound, self.envelopes, self.counts)
        cdef bint progressed = found is True or (found is not False and self.frames_found(found))
        if self.unmatched and self.match_parts():
            progressed = True
        if self.pending:
            indices = _testsome(self.pending)
            if indices:
                self.pending_done(indices)
                progressed = True
        for poll in self.pollers:
            if poll():
                progressed = True
        return progressed

    def burst(self, double seconds):
        """``polling.Poller.burst``."""
        cdef double end = _now() + seconds
        while not self.poll():
            if _now() > end:
                return False
        return True

    def until(self, object future, double seconds, double burst):
        """``polling.Poller.until``."""
        cdef double now = _now(), end = now + seconds, next_yield = now + burst
        cdef bint progressed = False
        done = future.done
        while not done():
            if self.poll():
                progressed = True
                continue
            now = _now()
            if now > end:
                break
            if now > next_yield:
                sched_yield()
                next_yield = _now() + burst
        return progressed


# ------------------------------------------------------------------ dispatch (dispatch.py)

cdef object _Message = _actor.Message
cdef object _finish_at_once = _actor.finish_at_once
cdef object _isawaitable = __import__("inspect").isawaitable
cdef object _monotonic = __import__("time").monotonic
cdef int _QUEUED = _actor.QUEUED, _NEVER_SUSPENDS = _actor.NEVER_SUSPENDS
cdef int _MESSAGE = _dispatch.MESSAGE, _REPLY = _dispatch.REPLY
cdef str _SYSTEM_ACTOR = _dispatch.SYSTEM_ACTOR, _STATE = _dispatch.STATE
cdef frozenset _VALUES = frozenset({type(None), bool, int, float, str, bytes, tuple, list, dict, _ndarray})
cdef object _Failure = _errors.Failure


cdef class Dispatch:
    """``dispatch.Dispatch``: a reply, and a message to an idle actor whose handler it knows (``ActorCell.handlers``)
    and cannot suspend, routed here; every other envelope by the reference, which this holds."""

    cdef object reference, system
    cdef Outbox outbox
    cdef dict cells, asks
    cdef object rank
    cdef bint _held

    def __init__(self, object system, dict cells, dict asks):
        self.reference = _dispatch.Dispatch(system, cells, asks)
        self.system, self.cells, self.asks, self.rank = system, cells, asks, system.rank

    @property
    def held(self):
        """``dispatch.Dispatch.held``, the reference's too (it routes what this leaves)."""
        return self._held

    @held.setter
    def held(self, bint value):
        self._held = value
        self.reference.held = value

    cpdef envelopes(self, object source, list envelopes):
        """Route ``envelopes`` from rank ``source``, in order."""
        for envelope in envelopes:
            if not self._routed(source, envelope):
                self.reference.envelope(source, envelope)

    def envelope(self, object source, object envelope):
        """Route one envelope from rank ``source``."""
        if not self._routed(source, envelope):
            self.reference.envelope(source, envelope)

    cdef bint _routed(self, object source, object envelope) except -1:
        """Route ``envelope`` if it is a case taken here; False to leave it to the reference."""
        if type(envelope) is not tuple:
            return False
        cdef tuple items = <tuple>envelope
        cdef Py_ssize_t count = len(items)
        if count == 4 and type(items[0]) is int and items[0] == _REPLY and type(items[1]) is int and items[3] is False:
            pending = self.asks.pop(items[1], None)
            if pending is not None:
                future = pending.future
                if not future.done():
                    future.set_result((items[2], items[3]))
            return True
        if count != 6 or type(items[0]) is not int or items[0] != _MESSAGE or source == self.rank:
            return False
        method, args, kwargs, ask_id = items[2], items[3], items[4], items[5]
        if (type(items[1]) is not str or type(method) is not str or type(args) is not tuple or type(kwargs) is not dict
                or type(ask_id) is not int or self.system.stopping):
            return False
        if self._held and not (items[1] == _SYSTEM_ACTOR and method == _STATE):
            return False  # the reference queues it for the loop
        for key in <dict>kwargs:
            if type(key) is not str:
                return False  # the reference refuses it
        cell = self.cells.get(items[1])
        if cell is None or not cell._started or cell.mailbox or cell.current is not None:
            return False
        entry = (<dict?>cell.handlers).get(method)
        if entry is None:
            return False
        handler, kind = <tuple>entry
        if kind == _QUEUED:
            return False
        reply_to = (source, ask_id) if ask_id >= 0 else None
        cell.current, cell.busy_since = method, _monotonic()
        try:
            result = handler(*<tuple>args, **<dict>kwargs) if kwargs else handler(*<tuple>args)
            if kind == _NEVER_SUSPENDS:
                result = _finish_at_once(result)
        except Exception as error:
            cell.inline_failed(_Message(method, args, kwargs, reply_to, source), error)
            return True
        finally:
            cell.current = None
        if type(result) not in _VALUES and _isawaitable(result):
            cell.inline_done(_Message(method, args, kwargs, reply_to, source), result)
        elif reply_to is not None:
            self._reply(source, ask_id, result)
        return True

    cdef _reply(self, object source, object ask_id, object result):
        """``system.reply`` to a remote asker: a value that travels compact leaves at once as its own frame."""
        if self.outbox is None:
            self.outbox = self.system.outbox
        if isinstance(result, _Failure) or (<Outbox>self.outbox).send(source, (_REPLY, ask_id, result, False)) < 0:
            self.system.reply((source, ask_id), result)


# ------------------------------------------------------------------ the send queue (outbox.py)
cdef Py_ssize_t _BATCH_MAX_MESSAGES = _outbox.BATCH_MAX_MESSAGES
cdef object _get_running_loop = _asyncio.get_running_loop


cdef inline double _now() noexcept:
    cdef timespec now
    clock_gettime(CLOCK_MONOTONIC, &now)
    return now.tv_sec + now.tv_nsec * 1e-9


cdef class Outbox:
    """``outbox.Outbox``: the same queue and frames, the turn's clock read in C (``frames`` is this module)."""

    cdef Endpoint _endpoint
    cdef Py_ssize_t _inline_bytes
    cdef object _track, _kick, _done
    cdef public dict queued
    cdef dict _queued_bytes, _seq
    cdef set _sent_this_turn
    cdef bint _flush_scheduled
    cdef double _turn_began, _turn_s
    cdef public long long messages, bytes

    def __init__(self, Endpoint endpoint, object frames, Py_ssize_t inline_bytes, object track, object kick,
                 double turn_s=_outbox.TURN_S):
        self._endpoint, self._inline_bytes, self._track, self._kick = endpoint, inline_bytes, track, kick
        self._turn_s = turn_s
        self.queued, self._queued_bytes, self._seq, self._sent_this_turn = {}, {}, {}, set()
        self._done = None

    def post(self, object dest, object obj):
        """``outbox.Outbox.post``."""
        cdef double now = _now()
        if self._sent_this_turn and now - self._turn_began > self._turn_s:
            self.flush()
        if dest not in self._sent_this_turn:
            if not self._sent_this_turn:
                self._turn_began = now
            self._sent_this_turn.add(dest)
            if not self._flush_scheduled:
                self._flush_scheduled = True
                _get_running_loop().call_soon(self.flush)
            return None
        body = compact_body(obj, self._inline_bytes)
        if body is None:
            return None
        queued = self.queued.get(dest)
        if queued is None:
            queued = self.queued[dest] = []
            self._queued_bytes[dest] = 0
        (<list>queued).append(body)
        cdef Py_ssize_t total = <Py_ssize_t>self._queued_bytes[dest] + PyBytes_GET_SIZE(body)
        self._queued_bytes[dest] = total
        self.messages += 1
        if len(<list>queued) >= _BATCH_MAX_MESSAGES or total >= self._inline_bytes:
            self._send_batch(dest)
        if self._done is None:
            self._done = _get_running_loop().create_future()
            self._done.set_result(0)
        return self._done

    def flush(self):
        """``outbox.Outbox.flush``."""
        self._flush_scheduled = False
        self._sent_this_turn.clear()
        for dest in list(self.queued):
            self._send_batch(dest)

    cpdef Py_ssize_t send(self, object dest, object obj) except? -2:
        """``outbox.Outbox.send``."""
        body = compact_body(obj, self._inline_bytes)
        if body is None:
            return -1
        if dest in self.queued:
            self._send_batch(dest)
        self.messages += 1
        self._send(dest, encode_compact(body, self.next_seq(dest)), 1)
        return PyBytes_GET_SIZE(body)

    def send_queued(self, object dest):
        """``outbox.Outbox.send_queued``."""
        if dest in self.queued:
            self._send_batch(dest)

    cpdef uint64_t next_seq(self, object dest):
        """``outbox.Outbox.next_seq``."""
        seq = self._seq.get(dest, 0)
        self._seq[dest] = seq + 1
        return seq

    cdef _send_batch(self, object dest):
        cdef list bodies = self.queued.pop(dest)
        del self._queued_bytes[dest]
        if len(bodies) == 1:
            self._send(dest, encode_compact(bodies[0], self.next_seq(dest)), 1)
        else:
            self._send(dest, encode_batch(bodies, self.next_seq(dest)), len(bodies))

    cdef _send(self, object dest, bytes frame, Py_ssize_t count):
        self.bytes += PyBytes_GET_SIZE(frame)
        request = self._endpoint.send(dest, frame)
        if request is not None:
            self._track(request, f"{count} small messages to rank {dest} ({len(frame)} bytes)", frame)
        else:
            self._kick()


# ------------------------------------------------------------------ a channel's receiving end (channel_receive.py)
cdef long long _CHANNEL_MAGIC = _channel_format.MAGIC
cdef long long _CH_SHAPE = _channel_format.SHAPE, _CH_MAX_DIMS = _channel_format.MAX_DIMS
cdef long long _CH_INLINE_BYTES = _channel_format.INLINE_BYTES
cdef long long _CH_FIT = _channel_format.FIT, _CH_INLINE = _channel_format.INLINE, _CH_OVER = _channel_format.OVER
cdef int _CH_HEADER_TAG = _channel_format.HEADER_TAG
cdef Py_ssize_t _KEPT_BUFFERS = _channel_receive.KEPT_BUFFERS
cdef object _BYTES = __import__("numpy").dtype("uint8")
cdef object _Arrival = _channel_format.Arrival


cdef object _view(object memory, object dtype, int ndim, cnp.npy_intp *dims):
    """An array of ``dtype`` and shape ``dims`` over the start of ``memory`` (a uint8 array), which it holds."""
    Py_INCREF(dtype)
    array = PyArray_NewFromDescr(cnp.ndarray, <cnp.dtype>dtype, ndim, dims, NULL,
                                 cnp.PyArray_DATA(<cnp.ndarray>memory), cnp.NPY_ARRAY_C_CONTIGUOUS | cnp.NPY_ARRAY_WRITEABLE,
                                 None)
    cnp.set_array_base(<cnp.ndarray>array, memory)
    cnp.PyArray_UpdateFlags(<cnp.ndarray>array, cnp.NPY_ARRAY_UPDATE_ALL)
    return array


cdef class ChannelSender:
    """``channel_send.Sender``: an array of plain numbers that fits MPI's count, on a lane sent on before, sent in
    C; a lane's first array, one over ``chunk_bytes`` and anything refused by the reference, which this holds."""

    cdef readonly object reference
    cdef object traffic, sending, codes
    cdef MPI_Comm comm
    cdef long long chunk_bytes, inline_bytes
    cdef bint closed

    def __init__(self, object MPI_module, Comm comm, Endpoint endpoint, object traffic, str name, long long lanes,
                 long long chunk_bytes, long long inline_bytes):
        self.reference = _channel_send.Sender(MPI_module, comm, endpoint, traffic, name, lanes, chunk_bytes,
                                              inline_bytes)
        self.traffic, self.sending, self.codes = traffic, self.reference.sending, _channel_format.CODES
        self.comm, self.chunk_bytes, self.inline_bytes = endpoint.comm, chunk_bytes, inline_bytes
        self.closed = False

    def send(self, object dest, object lane, object key, object array):
        """``channel_send.Sender.send``."""
        cdef long long fields[_CH_FIELDS]
        cdef long long nbytes, mode
        cdef int tag
        state = self.sending.get((dest, lane))
        if state is None or type(array) is not _ndarray or self.closed or type(key) is not tuple or len(key) != 3 \
                or type(key[0]) is not int or type(key[1]) is not int or type(key[2]) is not int:
            return self.reference.send(dest, lane, key, array)
        code = self.codes.get((<cnp.ndarray>array).dtype)
        nbytes = cnp.PyArray_NBYTES(<cnp.ndarray>array)
        if code is None or cnp.PyArray_NDIM(<cnp.ndarray>array) > _CH_MAX_DIMS or nbytes > self.chunk_bytes \
                or nbytes > INT_MAX or not cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>array):
            return self.reference.send(dest, lane, key, array)
        if nbytes <= self.inline_bytes:
            mode = _CH_INLINE
        else:
            capacity = state.capacity
            mode = _CH_FIT if capacity is not None and nbytes <= <long long>capacity else _CH_OVER
            if capacity is None:
                state.capacity = nbytes  # the same rule the receiver applies to the header
        tags = <tuple>state.tags
        tag = tags[0] if mode == _CH_FIT else tags[1]
        fields[0], fields[1], fields[2], fields[3] = _CHANNEL_MAGIC, lane, mode, nbytes
        try:
            fields[4], fields[5], fields[6], fields[7] = key[0], key[1], key[2], code
        except OverflowError:  # a key past 64 bits: the reference says so
            return self.reference.send(dest, lane, key, array)
        traffic = self.traffic
        for request in _send_array(self.comm, dest, _CH_HEADER_TAG, tag, fields, _CH_FIELDS, <cnp.ndarray>array,
                                   mode == _CH_INLINE):
            traffic.track(request, state.what, None)
        traffic.count_sent(1, nbytes + 8 * (_CH_SHAPE + cnp.PyArray_NDIM(<cnp.ndarray>array)))
        traffic.kick()

    def close(self):
        """``channel_send.Sender.close``."""
        self.closed = True
        self.reference.close()


cdef class ChannelReceiver:
    """``channel_receive.Receiver``: an inline array, or one whose data has filled its lane's buffer, with nothing of
    its lane before it, delivered in C, an array that fits its lane's buffer queued for its data in C, and the
    lanes' buffers delivered as they fill; every other arrival (a lane's first, an array over its lane's buffer, an
    inline one behind others of its lane, a header that is not one) by the reference, which this holds."""

    cdef readonly object reference
    cdef object ring, receiving, fitting, deliver, counts, slots, owner
    cdef list dtypes
    cdef MPI_Comm comm
    cdef long long lanes
    cdef Py_ssize_t slot_bytes
    cdef unsigned char *slot_data

    def __init__(self, object MPI_module, Comm comm, object counts, str name, long long lanes,
                 Py_ssize_t chunk_bytes, object deliver):
        reference = self.reference = _channel_receive.Receiver(MPI_module, comm, counts, name, lanes, chunk_bytes,
                                                               deliver)
        self.ring, self.receiving, self.fitting = reference.ring, reference.receiving, reference.fitting
        self.deliver, self.counts, self.slots, self.owner = deliver, counts, reference.slots, comm
        self.slot_data = <unsigned char *>cnp.PyArray_DATA(<cnp.ndarray>self.slots)
        self.slot_bytes = self.slots.shape[1]
        self.comm, self.lanes = comm.ob_mpi, lanes
        codes = _channel_format.DTYPES
        self.dtypes = [codes.get(code) for code in range(max(codes) + 1)]

    def poll(self):
        """``channel_receive.Receiver.poll``."""
        cdef bint progressed = False
        cdef MPI_Status status
        cdef int done = 0, count = 0
        cdef Py_ssize_t slot
        ring = self.ring
        while True:
            entry = <tuple>ring[0]
            _check(MPI_Test(&(<Request>entry[1]).ob_mpi, &done, &status))
            if not done:
                break
            ring.popleft()
            slot = entry[0]
            _check(MPI_Get_count(&status, MPI_BYTE, &count))
            if not self._taken(status.MPI_SOURCE, slot, count):
                self.reference.header_arrived(status.MPI_SOURCE, self.slots[slot], count)
            self._post_header(slot)
            progressed = True
        if self.fitting and self._fits_arrived():
            progressed = True
        if self.reference.over and self.reference.poll_over():
            progressed = True
        return progressed

    def cancel(self):
        """``channel_receive.Receiver.cancel``."""
        self.reference.cancel()

    cdef _post_header(self, Py_ssize_t slot):
        cdef MPI_Request handle
        _check(MPI_Irecv(self.slot_data + slot * self.slot_bytes, <int>self.slot_bytes, MPI_BYTE, MPI_ANY_SOURCE,
                         _CH_HEADER_TAG, self.comm, &handle))
        self.ring.append((slot, _pending(handle, self.slots)))

    cdef bint _taken(self, int source, Py_ssize_t slot, int count) except -1:
        """Deliver the array whose header is in ``slot`` if it is a case taken here; False to leave it to the
        reference (which also refuses a header that is not one)."""
        cdef const long long *words = <const long long *>(self.slot_data + slot * self.slot_bytes)
        cdef long long lane = words[1], mode = words[2], nbytes = words[3], code = words[7], ndim = words[8]
        cdef long long extent, elements = 1, head = 8 * (_CH_SHAPE + ndim), itemsize
        cdef cnp.npy_intp dims[7]
        cdef Py_ssize_t index
        cdef int done = 0
        if count < 8 * _CH_SHAPE or words[0] != _CHANNEL_MAGIC or not 0 <= lane < self.lanes or nbytes < 0:
            return False
        if not 0 <= ndim <= _CH_MAX_DIMS or not 0 <= code < len(self.dtypes) or (mode != _CH_FIT and mode != _CH_INLINE):
            return False
        dtype = self.dtypes[code]
        if dtype is None:
            return False
        for index in range(ndim):
            extent = words[_CH_SHAPE + index]
            if extent < 0 or (extent != 0 and elements > nbytes // extent):
                return False
            elements *= extent
            dims[index] = <cnp.npy_intp>extent
        itemsize = (<cnp.dtype>dtype).itemsize
        if nbytes % itemsize != 0 or elements != nbytes // itemsize:
            return False
        if count != head + (nbytes if mode == _CH_INLINE else 0) or (mode == _CH_INLINE and nbytes > _CH_INLINE_BYTES):
            return False
        state = self.receiving.get((source, lane))
        if state is None or (mode == _CH_INLINE and state.arrivals):
            return False
        key = (words[4], words[5], words[6])
        if mode == _CH_INLINE:
            Py_INCREF(dtype)
            array = PyArray_Empty(<int>ndim, dims, <cnp.dtype>dtype, 0)
            memcpy(cnp.PyArray_DATA(<cnp.ndarray>array), <const char *>words + head, nbytes)
        else:
            capacity, request = state.capacity, state.request
            if capacity is None or nbytes > <long long>capacity or request is None:
                return False  # (the reference refuses it)
            if not state.arrivals:  # the lane's posted receive is this array's: delivered now if it has landed
                _check(MPI_Test(&(<Request>request).ob_mpi, &done, MPI_STATUS_IGNORE))
            if not done:  # it waits for its data, after what came before it on its lane (``Receiver.header_arrived``)
                arrival = _Arrival(key, nbytes, dtype, tuple([words[_CH_SHAPE + index] for index in range(ndim)]))
                state.arrivals.append(arrival)
                state.fits.append(arrival)
                self.fitting[state] = None
                return True
            memory = state.posted
            state.posted = state.request = None
            self._post_fit(state)
            array = _view(memory, dtype, <int>ndim, dims)
        self._count(nbytes + head)
        self.deliver(source, lane, key, array)
        return True

    cdef _post_fit(self, object state):
        """``Receiver.post_fit``: the lane's fit receive posted ahead, into a buffer nothing else holds."""
        cdef list buffers = state.buffers
        cdef Py_ssize_t index
        cdef long long capacity = state.capacity
        cdef cnp.npy_intp size = capacity
        cdef MPI_Request handle
        if capacity > INT_MAX:
            self.reference.post_fit(state)  # (mpi4py's count check refuses it there)
            return
        buffer = None
        for index in range(len(buffers)):
            if Py_REFCNT_OF(PyList_GET_ITEM_BORROWED(buffers, index)) == 1:  # the list's is the only reference
                buffer = <object>PyList_GET_ITEM_BORROWED(buffers, index)
                break
        if buffer is None:
            Py_INCREF(_BYTES)
            buffer = PyArray_Empty(1, &size, <cnp.dtype>_BYTES, 0)
            if len(buffers) < _KEPT_BUFFERS:
                buffers.append(buffer)
        state.posted = buffer
        _check(MPI_Irecv(cnp.PyArray_DATA(<cnp.ndarray>buffer), <int>capacity, MPI_BYTE, state.source,
                         (<tuple>state.tags)[0], self.comm, &handle))
        state.request = _pending(handle, buffer)

    cdef bint _fits_arrived(self) except -1:
        """The lanes' fit receives that completed, in order, each posted again and its array delivered."""
        cdef bint progressed = False
        cdef int done
        for state in list(self.fitting):
            fits = state.fits
            while fits:
                done = 0
                _check(MPI_Test(&(<Request>state.request).ob_mpi, &done, MPI_STATUS_IGNORE))
                if not done:
                    break
                arrival = fits.popleft()
                arrival.memory = state.posted
                state.posted = state.request = None
                self._post_fit(state)
                self._deliver_ready(state)
                progressed = True
            if not fits:
                del self.fitting[state]
        return progressed

    cdef _deliver_ready(self, object state):
        """``Receiver.deliver_ready``."""
        cdef cnp.npy_intp dims[7]
        cdef Py_ssize_t index, ndim
        arrivals = state.arrivals
        while arrivals and arrivals[0].memory is not None:
            arrival = arrivals.popleft()
            shape = <tuple>arrival.shape
            ndim = len(shape)
            for index in range(ndim):
                dims[index] = shape[index]
            self._count(arrival.nbytes + 8 * (_CH_SHAPE + ndim))
            array = _view(arrival.memory, arrival.dtype, <int>ndim, dims)
            arrival.memory = None
            self.deliver(state.source, state.lane, arrival.key, array)

    cdef _count(self, long long nbytes):
        counts = self.counts
        counts.messages_received += 1
        counts.bytes_received += nbytes


# ------------------------------------------------------------------ a two-rank allreduce (pair_reduce.py)
cdef int _PAIR_TAG = _pair_reduce._TAG
cdef object _PAIR_DONE = (_pair_reduce.DONE, ())
cdef object _PAIR_MISMATCH = (_pair_reduce.MISMATCH, ())
cdef object _PAIR_CHECKING = _pair_reduce.CHECKING, _PAIR_SWAPPING = _pair_reduce.SWAPPING


cdef bint _ends_in_place(int count, MPI_Request *handles, double seconds) except -1:
    """``waits.ends_in_place`` of ``MPI_Testall`` on ``handles``: tested at least once."""
    cdef int done = 0
    cdef double end = _now() + seconds
    while True:
        _check(MPI_Testall(count, handles, &done, MPI_STATUSES_IGNORE))
        if done:
            return True
        if _now() > end:
            return False


cdef inline void *_start_of(cnp.ndarray array, str what) except NULL:
    """Where C-contiguous ``array``'s elements start (any address for none: MPI reads no byte of it)."""
    if not cnp.PyArray_IS_C_CONTIGUOUS(array) or cnp.PyArray_SIZE(array) > INT_MAX:
        raise ValueError(f"PairExchange: {what} must be C-contiguous, of at most MPI's int count of elements")
    return <void *>cnp.PyArray_DATA(array) if cnp.PyArray_SIZE(array) else <void *>&_PAIR_TAG


cdef class PairExchange:
    """``pair_reduce.PairExchange``: the same messages, as mpi4py posts them for the same arrays (an int64 row, the
    values by their MPI type), posted and tested in C."""

    cdef MPI_Comm check_comm, swap_comm
    cdef object owners  # the Comms whose handles these are, kept alive with them
    cdef object MPI_module
    cdef int other
    cdef dict types  # numpy dtype -> mpi4py's Datatype of it

    def __cinit__(self, object MPI_module, Comm check_comm, Comm swap_comm):
        self.check_comm, self.swap_comm = check_comm.ob_mpi, swap_comm.ob_mpi
        self.owners, self.MPI_module, self.other = (check_comm, swap_comm), MPI_module, 1 - swap_comm.Get_rank()
        self.types = {}

    cdef MPI_Datatype _type(self, cnp.dtype dtype) except *:
        """MPI's type of ``dtype``'s elements, as mpi4py picks it for a native-order array (by its type character)."""
        found = self.types.get(dtype)
        if found is None:
            if not dtype.isnative:
                raise ValueError(f"PairExchange: {dtype} is not in the machine's byte order")
            found = self.types[dtype] = self.MPI_module._typedict[dtype.char]
        return (<Datatype>found).ob_mpi

    def start(self, object row, object every, cnp.ndarray data, cnp.ndarray received, double inline_s):
        """``PairExchange.start``."""
        cdef MPI_Request handle
        cdef cnp.ndarray words, gathered
        cdef MPI_Datatype word
        cdef Py_ssize_t count
        if row is None or every is None:
            return self.swap(None, data, received, inline_s)
        words, gathered = <cnp.ndarray?>row, <cnp.ndarray?>every
        count = cnp.PyArray_SIZE(words)
        if cnp.PyArray_TYPE(words) != cnp.NPY_INT64 or cnp.PyArray_TYPE(gathered) != cnp.NPY_INT64 or \
                cnp.PyArray_SIZE(gathered) != 2 * count or count == 0:
            raise ValueError("PairExchange: the check takes an int64 row and room for two")
        word = self._type(words.dtype)
        _check(MPI_Iallgather(_start_of(words, "row"), <int>count, word, _start_of(gathered, "every"), <int>count,
                              word, self.check_comm, &handle))
        if not _ends_in_place(1, &handle, inline_s):
            return _PAIR_CHECKING, [_pending(handle, (words, gathered))]
        return self.swap(gathered, data, received, inline_s)

    def swap(self, object every, cnp.ndarray data, cnp.ndarray received, double inline_s):
        """``PairExchange.swap``."""
        cdef MPI_Request handles[2]
        cdef cnp.ndarray gathered
        cdef const long long *words
        cdef MPI_Datatype kind
        cdef void *sent
        if every is not None:
            gathered = <cnp.ndarray?>every
            if cnp.PyArray_TYPE(gathered) != cnp.NPY_INT64 or not cnp.PyArray_IS_C_CONTIGUOUS(gathered) or \
                    cnp.PyArray_SIZE(gathered) < 2:
                raise ValueError("PairExchange: the check's rows are C-contiguous int64")
            words = <const long long *>cnp.PyArray_DATA(gathered)
            if words[0] != words[cnp.PyArray_SIZE(gathered) // 2]:
                return _PAIR_MISMATCH
        if cnp.PyArray_TYPE(received) != cnp.PyArray_TYPE(data):
            raise ValueError("PairExchange: received must be of data's dtype")
        kind = self._type(data.dtype)
        sent = _start_of(data, "data")  # (each at most MPI's int count of elements: it says so)
        _check(MPI_Irecv(_start_of(received, "received"), <int>cnp.PyArray_SIZE(received), kind, self.other,
                         _PAIR_TAG, self.swap_comm, &handles[0]))
        _check(MPI_Isend(sent, <int>cnp.PyArray_SIZE(data), kind, self.other, _PAIR_TAG, self.swap_comm, &handles[1]))
        if _ends_in_place(2, handles, inline_s):
            return _PAIR_DONE
        return _PAIR_SWAPPING, [_pending(handles[0], received), _pending(handles[1], data)]
