"""Message encoding: one Python object <-> one frame plus zero-copy buffer parts.

A message is pickled with protocol 5. Contiguous numpy arrays and CPU torch
tensors become *out-of-band* buffers, so their bytes are never copied into the
pickle. On the wire a message is:

* a **frame** (one MPI message on ``FRAME_TAG``): a fixed header, the size of
  every part, and - for small messages - the parts themselves, inline;
* otherwise each part follows as its own MPI message(s) on a data tag derived
  from the message's sequence number, split into chunks of at most
  ``chunk_bytes`` so that buffers over 2 GiB travel with an MPI-3 library.

Part 0 is the pickle stream; parts 1.. are the out-of-band buffers. A small
tuple of plain values (see :mod:`.compact`) skips pickle: its frame carries one
inline part, the compact bytes. A *batch* frame carries several compact
messages to one rank, each an inline part, delivered in order.
"""

from __future__ import annotations

import copyreg
import io
import mmap
import os
import pickle
import struct
import sys
from dataclasses import dataclass

import numpy as np

from . import compact
from .errors import TransportError

FRAME_TAG = 1
_DATA_TAG_BASE = 2
_MAGIC = 0x4353504D  # "MPSC"
_HEADER = struct.Struct("<IIQ")  # magic, number of parts (high bit: inline), sequence
_INLINE_BIT = 1 << 31
_COMPACT_BIT = 1 << 30
_BATCH_BIT = 1 << 29
_REPLY_BIT = 1 << 28  # parts apart, of a reply: the ask's id (8 bytes) follows the header
_ASK_ID = struct.Struct("<q")
_COMPACT_COUNT = 1 | _INLINE_BIT | _COMPACT_BIT  # the part count field of a compact frame
_COMPACT_HEAD = _HEADER.size + 8  # header and the one part's size
_SIZE_TABLES = [struct.Struct(f"<{n}Q") for n in range(17)]
_ALIGN = 64


def data_tag(seq: int, tag_upper_bound: int) -> int:
    """The MPI tag that carries the buffer parts of message ``seq``."""
    return _DATA_TAG_BASE + seq % (tag_upper_bound - _DATA_TAG_BASE + 1)


def _rebuild_array(buffer: pickle.PickleBuffer, code: str, shape: tuple, fortran: bool) -> np.ndarray:
    array = np.frombuffer(buffer, dtype=compact.dtype_from_code(code))
    if len(shape) == 1:
        return array
    return array.reshape(shape, order="F" if fortran else "C")


def _reduce_array(array: np.ndarray):
    """Send a plain-dtype array as one out-of-band buffer (strided arrays are made contiguous)."""
    code = compact.plain_dtype_code(array.dtype)
    if code is None:
        return array.__reduce_ex__(5)
    flags = array.flags
    fortran = False
    if not flags.c_contiguous:
        fortran = flags.f_contiguous
        if not fortran:
            array = np.ascontiguousarray(array)
    data = array.view(np.int64) if array.dtype.kind in "mM" else array  # numpy exports no buffer of dates
    return _rebuild_array, (pickle.PickleBuffer(data), code, array.shape, fortran)


def _rebuild_tensor(array: np.ndarray, dtype_name: str, requires_grad: bool, parameter: bool):
    import torch

    tensor = torch.from_numpy(array)
    if str(tensor.dtype).removeprefix("torch.") != dtype_name:  # sent as integers of its element's size
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"a tensor of dtype {dtype_name!r}, which this torch does not have")
        tensor = tensor.view(dtype)
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad)


def _reduce_tensor(tensor):
    """Send a CPU tensor as a numpy view, so its storage goes out of band."""
    import torch

    if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.is_quantized:
        return tensor.__reduce_ex__(5)
    if tensor.requires_grad and tensor.grad_fn is not None:
        return tensor.__reduce_ex__(5)  # torch raises its own clear error for non-leaf tensors
    data = tensor.detach().resolve_conj().resolve_neg().contiguous()  # the values, whatever bits are set lazily
    dtype_name = str(data.dtype).removeprefix("torch.")
    try:
        array = data.numpy()
    except (TypeError, RuntimeError):  # a dtype numpy lacks (bfloat16, float8, ...): sent as integers of its size
        try:
            integers = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
            array = data.view(integers[data.element_size()]).numpy()
        except (KeyError, TypeError, RuntimeError):
            return tensor.__reduce_ex__(5)
    parameter = isinstance(tensor, torch.nn.Parameter)
    return _rebuild_tensor, (array, dtype_name, tensor.requires_grad, parameter)


class _Serializer:
    """A reusable protocol-5 pickler: reuse saves a microsecond per small message.

    Its dispatch table sends numpy arrays (and CPU torch tensors, once torch is
    imported) out of band without numpy's slower generic reduce. It holds what
    ``copyreg`` holds too (torch's layouts, a user's own reducers), as it is at
    each message: a pickler's own table replaces ``copyreg``'s.
    """

    def __init__(self) -> None:
        self._stream = io.BytesIO()
        self._buffers: list[pickle.PickleBuffer] = []
        self._ours: dict = {np.ndarray: _reduce_array}
        self._registered: dict | None = None  # copyreg's table when ours was last made
        self._table: dict = {}
        self._pickler = pickle.Pickler(self._stream, protocol=5, buffer_callback=self._buffers.append)
        self._pickler.dispatch_table = self._table
        self._busy = False

    def _current_table(self) -> None:
        torch = sys.modules.get("torch")
        if torch is not None and torch.Tensor not in self._ours:
            self._ours[torch.Tensor] = self._ours[torch.nn.Parameter] = _reduce_tensor
            self._registered = None
        if self._registered != copyreg.dispatch_table:
            self._registered = dict(copyreg.dispatch_table)
            self._table.clear()
            self._table.update(self._registered)
            self._table.update(self._ours)

    def __call__(self, obj: object) -> list:
        if self._busy:  # re-entered from a reducer: use a fresh one
            return _Serializer()(obj)
        self._current_table()
        self._busy = True
        stream, buffers = self._stream, self._buffers
        try:
            stream.seek(0)
            stream.truncate()
            self._pickler.dump(obj)
            parts = [memoryview(stream.getvalue())] + [buffer.raw() for buffer in buffers]
        finally:
            self._pickler.clear_memo()  # its memo refers to what it pickled: a sent array would live on in it
            buffers.clear()
            self._busy = False
        return parts


serialize = _Serializer()
serialize.__doc__ = "Pickle an object into parts: the pickle stream, then its out-of-band buffers."


@dataclass
class Encoded:
    """An encoded message ready to send: the frame and, unless inline, its parts."""

    frame: bytes
    parts: list[memoryview]  # empty when the parts are inline in the frame
    nbytes: int  # total payload bytes (all parts)


def deserialize(parts: list) -> object:
    """Inverse of :func:`serialize`."""
    return pickle.loads(parts[0], buffers=parts[1:])


def load(header: FrameHeader, parts: list) -> object:
    """The message of a decoded frame, given its parts (``header.inline_parts`` or the received ones); for a
    batch frame, see :func:`load_batch`."""
    if header.compact:
        return _load_compact(header, parts[0])
    return deserialize(parts)


def load_batch(header: FrameHeader) -> list:
    """The messages of a batch frame, in the order they were sent."""
    assert header.batch and header.inline_parts is not None
    return [_load_compact(header, part) for part in header.inline_parts]


def _load_compact(header: FrameHeader, data: memoryview) -> object:
    try:
        return compact.decode(data)
    except compact.NotCompact as error:
        raise TransportError(f"message seq {header.seq}: {error}") from None


def compact_body(obj: object, limit: int) -> bytes | None:
    """``obj``'s compact bytes if it qualifies and they take at most ``limit`` bytes, else None."""
    body = compact.encode(obj)
    return body if body is not None and len(body) <= limit else None


def encode_compact(body: bytes, seq: int) -> bytes:
    """The frame of one compact message (from :func:`compact_body`)."""
    return _HEADER.pack(_MAGIC, _COMPACT_COUNT, seq) + _SIZE_TABLES[1].pack(len(body)) + body


def encode_batch(bodies: list[bytes], seq: int) -> bytes:
    """One frame for several compact messages (from :func:`compact_body`), delivered in this order."""
    count = len(bodies)
    return b"".join([_HEADER.pack(_MAGIC, count | _INLINE_BIT | _COMPACT_BIT | _BATCH_BIT, seq),
                     _size_table(count).pack(*map(len, bodies)), *bodies])  # fmt: skip


def _size_table(count: int) -> struct.Struct:
    return _SIZE_TABLES[count] if count < len(_SIZE_TABLES) else struct.Struct(f"<{count}Q")


def encode(obj: object, seq: int, inline_bytes: int) -> Encoded:
    """Serialize ``obj`` and build its frame; small messages carry their parts inline.

    In an inline frame the pickle stream follows the part table directly and
    each buffer starts at a 64-byte aligned offset. A compact message is the
    header, its size and its compact bytes.
    """
    body = compact_body(obj, inline_bytes)
    if body is not None:
        return Encoded(encode_compact(body, seq), [], len(body))
    return encode_pickled(obj, seq, inline_bytes)


def encode_pickled(obj: object, seq: int, inline_bytes: int, answers: int = -1) -> Encoded:
    """:func:`encode` of a message that is not compact: pickled, its parts inline up to ``inline_bytes``. A reply
    to ask ``answers`` whose parts travel apart names the ask in its frame: its asker may have lent a buffer."""
    parts = serialize(obj)
    sizes = [part.nbytes for part in parts]
    total = sum(sizes)
    count = len(parts)
    if total > inline_bytes:
        if answers >= 0:
            head = _HEADER.pack(_MAGIC, count | _REPLY_BIT, seq) + _ASK_ID.pack(answers)
        else:
            head = _HEADER.pack(_MAGIC, count, seq)
        return Encoded(head + _size_table(count).pack(*sizes), parts, total)
    pieces = [_HEADER.pack(_MAGIC, count | _INLINE_BIT, seq), _size_table(count).pack(*sizes), parts[0]]
    offset = _HEADER.size + 8 * count + sizes[0]
    for part, size in zip(parts[1:], sizes[1:]):
        padding = -offset % _ALIGN
        pieces += [bytes(padding), part]
        offset += padding + size
    return Encoded(b"".join(pieces), [], total)


@dataclass(slots=True)
class FrameHeader:
    """What a receiver learns from a frame: sequence, part sizes, inline parts if any."""

    seq: int
    sizes: list[int]
    inline_parts: list[memoryview] | None
    compact: bool = False  # inline parts of compact bytes rather than a pickle stream (one unless a batch)
    batch: bool = False  # each inline part is a message of its own
    answers: int = -1  # a reply whose parts travel apart: the ask's id


def decode_frame(frame: memoryview) -> FrameHeader:
    """Parse a frame; raise :class:`TransportError` if it is not one of ours."""
    length = len(frame)
    if length < _HEADER.size:
        raise TransportError(f"frame of {length} bytes is shorter than the header")
    magic, count, seq = _HEADER.unpack_from(frame)
    if count == _COMPACT_COUNT and magic == _MAGIC and length >= _COMPACT_HEAD:  # the common small message
        (size,) = _SIZE_TABLES[1].unpack_from(frame, _HEADER.size)
        if _COMPACT_HEAD + size == length:
            return FrameHeader(seq, [size], [frame[_COMPACT_HEAD:]], True)
    if magic != _MAGIC:
        raise TransportError(f"frame starts with {magic:#x}, not an mpiscale frame")
    inline, is_compact, batch, reply = count & _INLINE_BIT, count & _COMPACT_BIT, count & _BATCH_BIT, count & _REPLY_BIT
    count &= ~(_INLINE_BIT | _COMPACT_BIT | _BATCH_BIT | _REPLY_BIT)
    if (is_compact and not inline or (count != 1 and is_compact and not batch) or (batch and not is_compact)
            or reply and inline):  # fmt: skip
        raise TransportError(f"frame with {count} parts has inconsistent flags {inline=} {is_compact=} {batch=} "
                             f"{reply=}")  # fmt: skip
    if batch:
        return _decode_batch(frame, seq, count)
    table = _HEADER.size + (_ASK_ID.size if reply else 0)
    offset = table + 8 * count
    if length < offset:
        raise TransportError("frame is shorter than its part table")
    sizes = _size_table(count).unpack_from(frame, table)
    if not inline:
        return FrameHeader(seq, list(sizes), None, answers=_ASK_ID.unpack_from(frame, _HEADER.size)[0] if reply else -1)
    parts = [frame[offset : offset + sizes[0]]]
    offset += sizes[0]
    for size in sizes[1:]:
        offset += -offset % _ALIGN
        parts.append(frame[offset : offset + size])
        offset += size
    if offset > length:
        raise TransportError("frame is shorter than its inline parts")
    return FrameHeader(seq, list(sizes), parts, bool(is_compact))


def _decode_batch(frame: memoryview, seq: int, count: int) -> FrameHeader:
    offset = _HEADER.size + 8 * count
    if len(frame) < offset:
        raise TransportError("batch frame is shorter than its part table")
    sizes = _size_table(count).unpack_from(frame, _HEADER.size)
    parts = []
    for size in sizes:
        parts.append(frame[offset : offset + size])
        offset += size
    if offset != len(frame):
        raise TransportError(f"batch frame of {len(frame)} bytes holds {offset} bytes of messages")
    return FrameHeader(seq, list(sizes), parts, True, True)


class BufferPool:
    """Recycles large receive buffers once nothing refers to them any more.

    A received array is a view of its receive buffer and is handed to user code,
    so the buffer cannot be given back explicitly. The pool keeps its own
    reference and treats a buffer as free when that is the only one left
    (CPython reference counting). Reusing memory that is already mapped spares a
    large message the page faults, and kernel zeroing, of fresh pages.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._buffers: list[np.ndarray] = []
        self._held = 0

    def take(self, size: int) -> memoryview:
        """A free pooled buffer of exactly ``size`` bytes, else a new one (pooled if it fits)."""
        for buffer in self._buffers:
            if buffer.nbytes == size and sys.getrefcount(buffer) == _FREE_REFCOUNT:
                return memoryview(buffer).cast("B")
        buffer = huge_page_buffer(size)
        if self._held + size > self.max_bytes:
            self._drop_free()
        if self._held + size <= self.max_bytes:
            self._buffers.append(buffer)
            self._held += size
        return memoryview(buffer).cast("B")

    def _drop_free(self) -> None:
        kept = [b for b in self._buffers if sys.getrefcount(b) > _FREE_REFCOUNT]
        self._buffers = kept
        self._held = sum(b.nbytes for b in kept)


# getrefcount of a free pooled buffer seen from a loop over the pool: the pool's
# list entry, the loop variable and getrefcount's own argument.
_FREE_REFCOUNT = 3
_POOL_MIN_BYTES = 1 << 20


def allocate(size: int, pool: BufferPool | None = None) -> memoryview:
    """A writable receive buffer of ``size`` bytes, at least 16-byte aligned.

    Small buffers are bytearrays (cheapest to make); larger ones are left
    uninitialised (no time spent zeroing what MPI overwrites); from 1 MiB on
    they are mappings of their own (:func:`huge_page_buffer`), taken from
    ``pool`` when one is given.
    """
    if size <= 65536:
        return memoryview(bytearray(size))
    if size < _POOL_MIN_BYTES:
        return memoryview(np.empty(size, dtype=np.uint8)).cast("B")
    return pool.take(size) if pool is not None else memoryview(huge_page_buffer(size)).cast("B")


def copied(part: memoryview) -> memoryview:
    """A buffer of its own holding ``part``'s bytes."""
    fresh = allocate(len(part))
    fresh[:] = part
    return fresh


def host_memory_bytes() -> int:
    """This host's physical memory: no message may declare more parts (unknown: no bound)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 62


def huge_page_buffer(size: int) -> np.ndarray:
    """``size`` bytes of fresh anonymous memory that the kernel may back with transparent huge pages.

    A large message is copied between processes a page at a time (Open MPI's single copy pins the sender's pages):
    with 2 MiB pages that costs less than with 4 KiB ones. ``np.empty`` of 16 MiB comes from glibc's heap once an
    earlier one was freed, 16 bytes past a page boundary and without huge pages; a mapping of its own is aligned to
    2 MiB for its size (Linux 6.7 on) and goes back to the system when dropped.
    """
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # (shared: no huge pages)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux; where the kernel's policy is "madvise", this opts in
        region.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(region, dtype=np.uint8)
