"""The 16-bit kernels against numpy (float16) and torch (bfloat16), bit for bit, hard cases included."""

import numpy as np
import pytest
import torch

from mpiscale.kernels.halves import SumOfBits, from_bits, to_bits


def hard_float32_values() -> np.ndarray:
    """Random values over float32's whole range, every float16 and bfloat16 value and the midpoints between them."""
    rng = np.random.default_rng(0)
    random_bits = rng.integers(0, 2**32, 400_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    halves = np.arange(2**16, dtype=np.uint16).view(np.float16).astype(np.float32)
    finite = np.sort(halves[np.isfinite(halves)])
    midpoints = (finite[:-1].astype(np.float64) + finite[1:]) / 2  # exact ties: the even neighbour wins
    brain = (np.arange(2**16, dtype=np.uint32) << 16).view(np.float32)
    brain_finite = np.sort(brain[np.isfinite(brain)]).astype(np.float64)
    brain_mid = (brain_finite[:-1] + brain_finite[1:]) / 2
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65520, 65519.99, 2**-24, 2**-25, 2**-26], np.float32)
    parts = [random_bits, halves, midpoints.astype(np.float32), brain, brain_mid.astype(np.float32), special]
    return np.concatenate([np.asarray(p, np.float32) for p in parts])


def test_float16_encoding_matches_numpy_bit_for_bit():
    values = hard_float32_values()
    ours = to_bits(values, "float16")
    with np.errstate(over="ignore"):
        theirs = values.astype(np.float16).view(np.uint16)
    nan = np.isnan(values)
    assert np.array_equal(ours[~nan], theirs[~nan])
    assert np.isnan(from_bits(ours[nan], "float16")).all()


def test_bfloat16_encoding_matches_torch_bit_for_bit():
    values = hard_float32_values()
    ours = to_bits(values, "bfloat16")
    theirs = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(values)
    assert np.array_equal(ours[~nan], theirs[~nan])
    assert np.isnan(from_bits(ours[nan], "bfloat16")).all()


@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_decoding_every_pattern_is_exact(kind):
    every = np.arange(2**16, dtype=np.uint16)
    ours = from_bits(every, kind)
    if kind == "float16":
        theirs = every.view(np.float16).astype(np.float32)
    else:
        theirs = torch.from_numpy(every.view(np.int16)).view(torch.bfloat16).float().numpy()
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_sum_of_rows_adds_in_float32_and_rounds_once(kind):
    rng = np.random.default_rng(1)
    rows = to_bits(rng.standard_normal((3, 10_000)).astype(np.float32) * 1e-3, kind).reshape(3, -1)
    values = from_bits(rows, kind).reshape(3, -1)
    expected = to_bits((values[0] + values[1]) + values[2], kind)  # float32, rank order, one rounding
    assert np.array_equal(SumOfBits(kind)(rows), expected)
    with pytest.raises(TypeError, match="uint16"):
        SumOfBits(kind)(values)
    with pytest.raises(ValueError, match="one of float16, bfloat16"):
        SumOfBits("float8")
