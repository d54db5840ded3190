"""Torch tensors as the numpy arrays a runtime :class:`~mpiscale.runtime.channels.Channel` carries.

The runtime never imports torch. A CPU tensor shares its memory with a numpy
view, so a tensor travels as that view; bfloat16 (which numpy lacks) travels as
its 16-bit patterns and a flag that restores its dtype. What arrives becomes a
tensor over the channel's buffer, without a copy.
"""

from __future__ import annotations

import numpy as np
import torch

#: A flag bit of a message's key: the array holds bfloat16 bit patterns.
BFLOAT16 = 1 << 1


def channel_array(tensor: torch.Tensor) -> tuple[np.ndarray, int]:
    """``tensor`` (detached, on the host, contiguous) as a numpy array, and the flag bits that restore its dtype. A
    refusal's message says what the value is ("is a tuple, not a tensor"): the caller names the value before it (no
    message is built for a send that goes through)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"is a {type(tensor).__name__}, not a tensor")
    if tensor.is_cpu and tensor.dtype is not torch.bfloat16 and tensor.is_contiguous():
        try:  # the common case, in the fewest calls (a stage sends after every forward and backward)
            return tensor.detach().numpy(), 0
        except (TypeError, RuntimeError):
            pass  # (a dtype numpy lacks, a conjugate view: said below)
    host = tensor.detach().cpu().contiguous()
    if host.dtype == torch.bfloat16:
        return host.view(torch.int16).numpy(), BFLOAT16
    try:
        return host.numpy(), 0
    except TypeError as error:
        raise TypeError(f"is a tensor of {host.dtype}, which cannot travel ({error})") from None


def channel_tensor(array: np.ndarray, flags: int) -> torch.Tensor:
    """The tensor an arrived array holds (sharing its memory), its dtype restored from ``flags``."""
    tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if flags & BFLOAT16 else tensor
