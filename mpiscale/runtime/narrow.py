"""Sums of 16-bit floats on the wire: IEEE half (float16) and bfloat16, carried as uint16 bit patterns.

MPI has no 16-bit float sum, so a plain reduction of a half-precision buffer
must widen it to float32 first and sends twice the bytes. These user-defined
reductions add two 16-bit buffers in float32 and round the result back to 16
bits (to nearest, ties to even) at every addition, which is what a gradient
compressor wants: half the bytes of float32 on every link, as PyTorch DDP's
fp16 and bf16 compression hooks send. The buffers are ``uint16`` arrays of bit
patterns, so numpy needs no bfloat16 type and the runtime needs no torch.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np


def bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float32 values as bfloat16 bit patterns (uint16), rounded to nearest, ties to even; NaN stays NaN."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    result = rounded.astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        result[nan] = 0x7FC0
    return result


def bfloat16_values(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """bfloat16 bit patterns (uint16) as float32 values (exact)."""
    widened = bits.astype(np.uint32) << 16
    if out is None:
        return widened.view(np.float32)
    out[...] = widened.view(np.float32).reshape(out.shape)
    return out


def float16_bits(values: np.ndarray) -> np.ndarray:
    """float32 values as IEEE half bit patterns (uint16), rounded to nearest, ties to even."""
    return np.asarray(values, dtype=np.float32).astype(np.float16).view(np.uint16)


def float16_values(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """IEEE half bit patterns (uint16) as float32 values (exact)."""
    if out is None:
        return bits.view(np.float16).astype(np.float32)
    out[...] = bits.view(np.float16).reshape(out.shape)
    return out


def _add_float16(incoming: Any, inout: Any, datatype: Any) -> None:
    a = np.frombuffer(incoming, dtype=np.float16)
    b = np.frombuffer(inout, dtype=np.float16)
    np.add(a, b, out=b)  # numpy adds halves in float32 and rounds once


def _add_bfloat16(incoming: Any, inout: Any, datatype: Any) -> None:
    a = np.frombuffer(incoming, dtype=np.uint16)
    b = np.frombuffer(inout, dtype=np.uint16)
    b[...] = bfloat16_bits(bfloat16_values(a) + bfloat16_values(b))


def check_narrow(op: str, array: np.ndarray) -> None:
    """A 16-bit sum needs a uint16 buffer of bit patterns: anything else would be summed as garbage."""
    if op in ("sum_float16", "sum_bfloat16") and array.dtype != np.uint16:
        raise TypeError(f"{op} sums 16-bit patterns: pass uint16 (float16_bits, bfloat16_bits), not {array.dtype}")


def narrow_ops(MPI: ModuleType) -> dict[str, Any]:
    """The reductions ``sum_float16`` and ``sum_bfloat16`` (over uint16 buffers), created once per process."""
    global _OPS
    if _OPS is None:
        _OPS = {
            "sum_float16": MPI.Op.Create(_add_float16, commute=True),
            "sum_bfloat16": MPI.Op.Create(_add_bfloat16, commute=True),
        }
    return _OPS


_OPS: dict[str, Any] | None = None
