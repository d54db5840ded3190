"""Which message path runs: the compiled one (``_wire``, built by ``pip install``, ``launch/setup.sh`` or
``python -m mpiscale.wire_build``) or the pure-Python
reference (:mod:`.transport`, :mod:`.compact` and :class:`Endpoint` here), and why.

Both write the same frames, so ranks on either path talk to each other. The compiled module is used when it is
built, built from the source beside it (a build older than its ``.pyx`` is stale and left out: it would not be
the code in the tree), and built against the MPI library that runs; ``MPISCALE_PURE_PYTHON=1`` forces the
reference. The choice is made once per process (:func:`chosen`); ``mpiscale doctor`` says which path runs.
"""

from __future__ import annotations

import hashlib
import os
from functools import cache
from importlib import import_module
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np

from ..mpi_library import library_line
from . import channel_receive, channel_send, compact, dispatch, outbox, pair_reduce, polling, transport
from .channel_format import channel_header
from .errors import MessageRefused, TransportError

PURE_ENV = "MPISCALE_PURE_PYTHON"
_SOURCE = Path(__file__).with_name("_wire.pyx")


class Endpoint:
    """Frames sent to and matched from the other ranks of one communicator on ``transport.FRAME_TAG``."""

    def __init__(self, MPI: ModuleType, comm: Any) -> None:
        self._MPI = MPI
        self._comm = comm
        self._status = MPI.Status()

    def send(self, dest: int, frame: bytes) -> Any:
        """Start sending ``frame`` to ``dest``: None once it has left, else its pending Request."""
        request = self._comm.Isend([frame, self._MPI.BYTE], dest, transport.FRAME_TAG)
        return None if request.Test() else request

    def send_array(self, dest: int, header_tag: int, data_tag: int, fields: tuple, array: Any, inline: bool) -> list:
        """Start sending a channel's message to ``dest``: a header of int64 words (``fields``, then the array's
        number of dimensions and its shape) on ``header_tag``, then the bytes of ``array`` (C-contiguous, at most
        MPI's int count): after the header in its message when ``inline``, else on ``data_tag``; the requests still
        pending (each holds its buffer)."""
        MPI, comm = self._MPI, self._comm
        header = channel_header(fields, array)
        if inline:
            header = np.concatenate((header.view(np.uint8), array.reshape(-1).view(np.uint8)))
        pending = []
        for buffer, tag in ((header, header_tag),) if inline else ((header, header_tag), (array, data_tag)):
            request = comm.Isend([buffer, MPI.BYTE], dest, tag)
            if not request.Test():
                pending.append(request)
        return pending

    def drain(self, inbound: dict, deliver: Any, counts: Any) -> tuple | bool:
        """Deliver each frame that has arrived and is a complete compact one (one message or a batch) from a source
        with nothing waiting before it (``inbound``: the engine's queues by source), in arrival order: its messages
        to ``deliver.envelopes``, counted in ``counts`` (``messages_received``, ``bytes_received``). The first other
        frame, as :meth:`match` gives it; else True when it delivered any, False when no frame had arrived."""
        delivered = False
        while (found := self.match()) is not None:
            source, frame, request = found
            if request is not None or inbound.get(source):
                return found
            try:
                header = transport.decode_frame(frame)
            except TransportError:
                return found  # the engine reads it again, and refuses it
            if header.inline_parts is None or not header.compact:
                return found
            try:
                parts = header.inline_parts
                messages = transport.load_batch(header) if header.batch else [transport.load(header, parts)]
                counts.bytes_received += len(frame)
                counts.messages_received += len(messages)
                deliver.envelopes(source, messages)
            except Exception as error:
                raise MessageRefused.of(source, error) from error
            delivered = True
        return delivered

    def match(self) -> tuple[int, memoryview, Any] | None:
        """The next frame that has arrived from any rank, as (source, frame, request), the request None when its
        bytes are in ``frame`` already; None when no frame waits."""
        MPI, status = self._MPI, self._status
        message = self._comm.Improbe(MPI.ANY_SOURCE, transport.FRAME_TAG, status)
        if message is None:
            return None
        frame = memoryview(bytearray(status.Get_count(MPI.BYTE)))
        request = message.Irecv([frame, MPI.BYTE])
        return status.Get_source(), frame, None if request.Test() else request


#: The reference path, under the compiled module's names.
PURE = SimpleNamespace(
    compact_encode=compact.encode,
    compact_decode=compact.decode,
    compact_body=transport.compact_body,
    encode_compact=transport.encode_compact,
    encode_batch=transport.encode_batch,
    load=transport.load,
    load_batch=transport.load_batch,
    Endpoint=Endpoint,
    Dispatch=dispatch.Dispatch,
    Outbox=outbox.Outbox,
    ChannelReceiver=channel_receive.Receiver,
    ChannelSender=channel_send.Sender,
    testsome=polling.testsome,
    Poller=polling.Poller,
    PairExchange=pair_reduce.PairExchange,
)


@cache
def chosen() -> tuple[Any, str]:
    """The functions of the path that runs (the compiled module, or :data:`PURE`) and its name: "compiled", or
    "pure-Python (why)". Decided at the first call, once MPI is loaded: the compiled module imports ``mpi4py.MPI``,
    which must not initialise MPI before the runtime has set its thread level."""
    from ..wire_build import REBUILD  # (here: python -m mpiscale.wire_build must not find itself imported)

    if os.environ.get(PURE_ENV, "0") not in ("", "0"):
        return PURE, f"pure-Python ({PURE_ENV}=1)"
    try:
        _wire = import_module(f"{__package__}._wire")
    except ImportError as error:
        return PURE, f"pure-Python (the compiled module is not built: {error}; build it: {REBUILD})"
    from mpi4py import MPI

    stale = stale_build(_wire, _SOURCE, MPI.Get_library_version())
    if stale is not None:
        return PURE, f"pure-Python ({stale}; build it again: {REBUILD})"
    return _wire, "compiled"


def stale_build(module: Any, source: Path, library_version: str) -> str | None:
    """Why a built ``module`` is not the code to run: built from another ``source`` than the one beside it, or
    against another MPI library than the one of ``library_version``; None when it is current."""
    if source.exists() and hashlib.sha256(source.read_bytes()).hexdigest() != module.SOURCE_SHA256:
        return f"the compiled module is older than {source.name}"
    running = library_line(library_version)
    if running != module.BUILT_AGAINST:
        return f"the compiled module was built against {module.BUILT_AGAINST}, not {running}"
    return None


def message_path() -> tuple[str, bool]:
    """The path that runs ("compiled", or "pure-Python (why)") and whether it is the one asked for: False when a
    missing, stale or mismatched build left the reference to run."""
    path = chosen()[1]
    return path, path == "compiled" or path.startswith(f"pure-Python ({PURE_ENV}")
