"""A write-ahead log: records of named arrays appended to one file, each made durable before ``append`` returns.

File layout: an 8-byte magic ``MPSWAL01``, then records, each

    length  u32   bytes of the body
    crc     u32   CRC-32C of the body
    body          step (u64), header length (u32), a JSON header naming each
                  array's dtype and shape, then the arrays' bytes in order

``replay`` reads records back in order. A process killed in the middle of an
append leaves a *torn* last record (shorter than its length, or failing its
checksum, and reaching the end of the file): it is dropped and reported, and
``WriteAheadLog`` opened on the file cuts it off before appending. Damage
anywhere else (a bad checksum with records after it, a wrong magic) is a
``DataFileError`` naming the file and the byte offset: replaying past it would
silently lose updates.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field

import crc32c
import numpy as np

from .errors import DataFileError

MAGIC = b"MPSWAL01"
_FRAME = struct.Struct("<II")  # length, crc
_BODY = struct.Struct("<QI")  # step, header length


@dataclass
class ReplayReport:
    """What ``replay`` found: complete records, and the bytes of a torn last record it dropped."""

    records: int = 0
    torn_bytes: int = 0
    steps: list[int] = field(default_factory=list)


def encode_record(step: int, arrays: dict[str, np.ndarray]) -> bytes:
    """One record's bytes (frame and body), as ``append`` writes them: to send a record elsewhere first."""
    contiguous = {name: np.ascontiguousarray(array) for name, array in arrays.items()}
    objects = [name for name, array in contiguous.items() if array.dtype.hasobject]
    if objects:
        raise TypeError(f"arrays of Python objects cannot be logged (their bytes are pointers): {', '.join(objects)}")
    header = json.dumps([[name, a.dtype.str, list(a.shape)] for name, a in contiguous.items()]).encode()
    body = b"".join([_BODY.pack(step, len(header)), header, *(a.tobytes() for a in contiguous.values())])
    return _FRAME.pack(len(body), crc32c.crc32c(body)) + body


def _decode(body: bytes) -> tuple[int, dict[str, np.ndarray]]:
    step, header_length = _BODY.unpack_from(body)
    offset = _BODY.size + header_length
    arrays = {}
    for name, dtype, shape in json.loads(body[_BODY.size : offset]):
        kind = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        arrays[name] = np.frombuffer(body, kind, count, offset).reshape(shape).copy()
        offset += count * kind.itemsize
    return step, arrays


def _records(path: str, data: bytes) -> Iterator[tuple[int, int, bytes | None]]:
    """(offset, end, body) per record; body None for a torn last record."""
    if data[: len(MAGIC)] != MAGIC:
        raise DataFileError(path, f"not a write-ahead log (the first bytes are {data[:8]!r}, not {MAGIC!r})")
    offset = len(MAGIC)
    while offset < len(data):
        if offset + _FRAME.size > len(data):
            yield offset, len(data), None
            return
        length, crc = _FRAME.unpack_from(data, offset)
        end = offset + _FRAME.size + length
        body = data[offset + _FRAME.size : end]
        if end > len(data):
            yield offset, len(data), None
            return
        if crc32c.crc32c(body) != crc:
            if end == len(data):
                yield offset, end, None
                return
            raise DataFileError(
                path, f"the record at byte {offset} fails its checksum and {len(data) - end} bytes follow it: "
                "the log is damaged, not torn; the updates from there on cannot be trusted",
            )  # fmt: skip
        yield offset, end, body
        offset = end


def replay(path: str | os.PathLike, report: ReplayReport | None = None) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
    """(step, arrays) of every complete record in order; a torn last record is dropped and counted in ``report``."""
    path = os.fspath(path)
    with open(path, "rb") as stream:
        data = stream.read()
    for offset, end, body in _records(path, data):
        if body is None:
            if report is not None:
                report.torn_bytes = end - offset
            return
        step, arrays = _decode(body)
        if report is not None:
            report.records += 1
            report.steps.append(step)
        yield step, arrays


class WriteAheadLog:
    """Appends records to ``path`` (created if missing; a torn last record is cut off first)."""

    def __init__(self, path: str | os.PathLike, sync: bool = True) -> None:
        self.path, self.sync = os.fspath(path), sync
        self.report = ReplayReport()
        if os.path.exists(self.path) and os.path.getsize(self.path) > 0:
            for _ in replay(self.path, self.report):
                pass
            size = os.path.getsize(self.path)
            self._stream = open(self.path, "r+b")
            self._stream.truncate(size - self.report.torn_bytes)
            self._stream.seek(0, os.SEEK_END)
        else:
            self._stream = open(self.path, "w+b")
            self._stream.write(MAGIC)
            self._durable()

    def append(self, step: int, arrays: dict[str, np.ndarray]) -> None:
        """Add a record; it is on the disk (fsync) when this returns, unless ``sync`` is False."""
        self.append_encoded(encode_record(step, arrays))

    def append_encoded(self, record: bytes | bytearray | memoryview) -> None:
        """Add a record made by ``encode_record`` (here or on another rank), durable like ``append``."""
        self._stream.write(record)
        self._durable()

    def reset(self) -> None:
        """Drop every record (after a checkpoint has made them redundant)."""
        self._stream.seek(len(MAGIC))
        self._stream.truncate()
        self._durable()

    def _durable(self) -> None:
        self._stream.flush()
        if self.sync:
            os.fsync(self._stream.fileno())

    def close(self) -> None:
        self._stream.close()

    def __enter__(self) -> WriteAheadLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
