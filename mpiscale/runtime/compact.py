"""A pickle-free encoding for small messages of plain values.

Most runtime messages are small tuples of names, numbers and a few small numpy arrays (an envelope: kind, actor,
method, arguments, ask id). Pickling one costs microseconds: a Python reducer call per array and a rebuild call per
array on the other side. Such a tuple is written here in a small tagged binary format instead, which the compiled
message path (``_wire.pyx``) writes and reads in C in a few hundred nanoseconds; this module is the reference it is
held to, byte for byte and error for error.

What qualifies (anything else goes through pickle, so no value changes type):

* the top level is a tuple;
* each element is a scalar of exactly ``None``, ``bool``, ``int``, ``float``, ``str`` or ``bytes`` (subclasses
  such as enums or numpy scalars do not qualify), a C-contiguous ``numpy.ndarray`` (exactly, not a subclass) of a
  plain dtype, at most :data:`MAX_ARRAY_BYTES` and :data:`MAX_DIMS` dimensions, a dict with ``str`` keys and scalar
  values, or a tuple of scalars and such arrays.

The format, little-endian (``u32`` counts and lengths, ``i64`` integers)::

    message := 't' count item*                   a tuple: the top level
    item    := value | 't' count value*          a tuple of values
             | 'm' count ('s' text value)*       a dict of str to scalars
    value   := scalar | 'a' array
    scalar  := 'N' | 'T' | 'F'                   None, True, False
             | 'i' i64 | 'I' u32 bytes           an int (beyond 64 bits: two's complement, little-endian)
             | 'd' f64 | 's' u32 utf8 | 'b' u32 bytes
    array   := u8 code-length code u8 ndim i64*ndim data   (code: the dtype's ``str``; data: its C-order bytes)

Reading is safe against damaged or crafted bytes: every length is checked against the bytes there before it is
used, the grammar nests at most two deep, and an array's dtype, dimensions and extents are checked before numpy
sees them; anything else is a :class:`NotCompact` naming the byte. Received arrays are writable copies, as pickled
ones are writable views. The dtype codes here (:func:`plain_dtype_code`, :func:`dtype_from_code`) are also those
of the pickled path's out-of-band arrays.
"""

from __future__ import annotations

import struct
import warnings
from typing import Any, cast

import numpy as np

from ..errors import MpiscaleError

#: Largest array that travels in a compact message (the message's whole body is at most ``inline_bytes``); larger
#: ones go out of band, without a copy. Copying 64 KiB in and out costs less than pickling the array: an 8 KiB
#: vector asked back took 24 µs pickled.
MAX_ARRAY_BYTES = 65536
#: Most dimensions of an array in a compact message, and the largest extent (and element count) one may declare.
MAX_DIMS = 32
MAX_EXTENT = 1 << 40
_U32, _I64, _F64 = struct.Struct("<I"), struct.Struct("<q"), struct.Struct("<d")
_INT64_MIN, _INT64_END, _U32_MAX = -(1 << 63), 1 << 63, 0xFFFFFFFF
_codes: dict[np.dtype, str | None] = {}
_dtypes: dict[str, np.dtype] = {}


class NotCompact(MpiscaleError, ValueError):
    """The bytes are not a compact message (a corrupt or foreign frame)."""


def plain_dtype_code(dtype: np.dtype) -> str | None:
    """``dtype.str`` for a dtype whose bytes are its values, None for object, structured or sub-array ones
    (cached)."""
    code = _codes.get(dtype, "")
    if code == "":
        plain = not dtype.hasobject and dtype.fields is None and dtype.subdtype is None
        code = _codes[dtype] = dtype.str if plain else None
    return code


def dtype_from_code(code: str) -> np.dtype:
    """The dtype a :func:`plain_dtype_code` names (cached); ValueError for one that holds objects."""
    dtype = _dtypes.get(code)
    if dtype is None:
        with warnings.catch_warnings():  # a deprecated alias ("a" for "S") is no code a sender writes: refused
            warnings.simplefilter("error", DeprecationWarning)
            dtype = np.dtype(code)
        if dtype.hasobject:
            raise ValueError(f"dtype {code!r} holds objects")
        _dtypes[code] = dtype
    return dtype


def array_dtype(code: bytes) -> np.dtype | None:
    """The dtype of an array entry's ``code``, or None when it names none a compact array may have (not ASCII, not
    a dtype, or one whose items are not plain bytes of a nonzero size)."""
    try:
        dtype = dtype_from_code(code.decode("ascii"))
    except Exception:  # noqa: BLE001 - numpy raises TypeError, ValueError or others for damaged codes
        return None
    if dtype.fields is not None or dtype.subdtype is not None or dtype.itemsize == 0:
        return None
    return dtype


# ---------------------------------------------------------------------------------------------------- encoding
def encode(message: object) -> bytes | None:
    """The compact bytes of ``message``, or None when it does not qualify."""
    if type(message) is not tuple:
        return None
    out = bytearray(b"t")
    out += _U32.pack(len(message))
    for item in message:
        kind = type(item)
        if kind is tuple:
            out += b"t"
            out += _U32.pack(len(item))
            for value in item:
                if not _value(out, value):
                    return None
        elif kind is dict:
            out += b"m"
            out += _U32.pack(len(item))
            for key, value in item.items():
                if type(key) is not str or not _scalar(out, key) or not _scalar(out, value):
                    return None
        elif not _value(out, item):
            return None
    return bytes(out)


def _value(out: bytearray, value: object) -> bool:
    return _array(out, value) if type(value) is np.ndarray else _scalar(out, value)


def _scalar(out: bytearray, value: object) -> bool:
    kind = type(value)
    if value is None:
        out += b"N"
    elif kind is bool:
        out += b"T" if value else b"F"
    elif kind is int:
        number: int = value  # type: ignore[assignment]
        if _INT64_MIN <= number < _INT64_END:
            out += b"i"
            out += _I64.pack(number)
        else:
            data = number.to_bytes((number.bit_length() + 8) // 8, "little", signed=True)
            if len(data) > _U32_MAX:
                return False
            out += b"I"
            out += _U32.pack(len(data))
            out += data
    elif kind is float:
        out += b"d"
        out += _F64.pack(value)
    elif kind is str or kind is bytes:
        data = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else cast(bytes, value)
        if len(data) > _U32_MAX:
            return False
        out += b"s" if kind is str else b"b"
        out += _U32.pack(len(data))
        out += data
    else:
        return False
    return True


def _array(out: bytearray, array: np.ndarray) -> bool:
    code = plain_dtype_code(array.dtype)
    if (code is None or array.dtype.itemsize == 0 or array.nbytes > MAX_ARRAY_BYTES or array.ndim > MAX_DIMS
            or not array.flags.c_contiguous):  # fmt: skip
        return False
    out += b"a"
    out += bytes((len(code),))
    out += code.encode("ascii")
    out += bytes((array.ndim,))
    for extent in array.shape:
        out += _I64.pack(extent)
    out += array.tobytes()
    return True


# ---------------------------------------------------------------------------------------------------- decoding
class _Reader:
    """A cursor over a compact body; every read checks that its bytes are there."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def fail(self, why: str) -> NotCompact:
        return NotCompact(f"not a compact message: {why}")

    def take(self, count: int) -> int:
        """The offset of the next ``count`` bytes, which the cursor passes."""
        start = self.at
        if count > len(self.data) - start:
            raise self.fail(f"it ends early at byte {start}")
        self.at = start + count
        return start

    def tag(self) -> int:
        return self.data[self.take(1)]

    def u32(self) -> int:
        return _U32.unpack_from(self.data, self.take(4))[0]

    def i64(self) -> int:
        return _I64.unpack_from(self.data, self.take(8))[0]

    def unexpected(self, tag: int) -> NotCompact:
        return self.fail(f"byte {self.at - 1} ({tag:#04x}) is not what a compact message holds there")

    def value(self, arrays: bool) -> Any:
        """The scalar (or, with ``arrays``, the array) at the cursor."""
        tag = self.tag()
        if tag == 0x4E:  # N
            return None
        if tag == 0x54 or tag == 0x46:  # T, F
            return tag == 0x54
        if tag == 0x69:  # i
            return self.i64()
        if tag == 0x64:  # d
            return _F64.unpack_from(self.data, self.take(8))[0]
        if tag == 0x49 or tag == 0x73 or tag == 0x62:  # I, s, b
            size = self.u32()
            data = self.data[self.take(size) : self.at]
            if tag == 0x49:
                return int.from_bytes(data, "little", signed=True)
            if tag == 0x62:
                return data
            try:
                return data.decode("utf-8", "surrogatepass")
            except UnicodeDecodeError:
                raise self.fail(f"the text at byte {self.at - size} is not UTF-8") from None
        if tag == 0x61 and arrays:  # a
            return self.array(self.at - 1)
        raise self.unexpected(tag)

    def array(self, start: int) -> np.ndarray:
        size = self.tag()
        code = self.data[self.take(size) : self.at]
        dtype = array_dtype(code)
        if dtype is None:
            raise self.fail(f"the array at byte {start} has dtype code {code!r}, not a plain dtype's")
        ndim = self.tag()
        if ndim > MAX_DIMS:
            raise self.fail(f"the array at byte {start} has {ndim} dimensions, over {MAX_DIMS}")
        shape, elements = [], 1
        for _ in range(ndim):
            extent = self.i64()
            elements *= max(extent, 0)
            if not 0 <= extent <= MAX_EXTENT or elements > MAX_EXTENT:
                raise self.fail(f"the array at byte {start} has an extent of {extent}")
            shape.append(extent)
        offset = self.take(elements * dtype.itemsize)
        return np.frombuffer(bytearray(self.data[offset : self.at]), dtype=dtype).reshape(shape)


def decode(data: Any) -> tuple:
    """The message whose compact bytes are ``data``; :class:`NotCompact` if they are not well formed."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise NotCompact(f"not a compact message: {type(data).__name__} is not bytes")
    reader = _Reader(bytes(data))
    tag = reader.tag()
    if tag != 0x74:  # t
        raise reader.unexpected(tag)
    items: list = []
    for _ in range(reader.u32()):
        tag = reader.tag()
        if tag == 0x74:  # t
            items.append(tuple([reader.value(True) for _ in range(reader.u32())]))
        elif tag == 0x6D:  # m
            entries = {}
            for _ in range(reader.u32()):
                key_tag = reader.tag()
                if key_tag != 0x73:  # s
                    raise reader.unexpected(key_tag)
                reader.at -= 1
                key = reader.value(False)
                entries[key] = reader.value(False)
            items.append(entries)
        else:
            reader.at -= 1
            items.append(reader.value(True))
    if reader.at != len(reader.data):
        raise reader.fail(f"{len(reader.data) - reader.at} bytes follow the message")
    return tuple(items)
