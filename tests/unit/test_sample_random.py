"""Per-sample random streams: known answers, determinism, independence, bad input."""

import numpy as np
import pytest

from mpiscale.io import SampleRandom
from mpiscale.kernels.philox import block_words

# Random123's published known-answer vectors for philox4x32-10: counter, key, result.
KNOWN_ANSWERS = [
    ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    (
        [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344],
        [0xA4093822, 0x299F31D0],
        [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1],
    ),
]


@pytest.mark.parametrize("counter, key, expected", KNOWN_ANSWERS)
def test_philox_matches_published_known_answers(counter, key, expected):
    got = block_words(np.array(counter, dtype=np.uint64), np.array(key, dtype=np.uint64))
    assert got.tolist() == expected


def test_values_depend_only_on_seed_epoch_sample_and_stream():
    streams = SampleRandom(7)
    everything = streams.uniform(3, range(1000), 6)
    rng = np.random.default_rng(0)
    for _ in range(5):  # any subset, in any order, in any batch gives the same rows
        subset = rng.choice(1000, size=200, replace=False)
        assert np.array_equal(streams.uniform(3, subset, 6), everything[subset])
    assert np.array_equal(SampleRandom(7).uniform(3, [999, 0], 6), everything[[999, 0]])
    # a longer request extends, never changes, the first values
    assert np.array_equal(streams.uniform(3, range(1000), 9)[:, :6], everything)


def test_different_seeds_epochs_streams_and_samples_differ():
    base = SampleRandom(1).uniform(0, range(100), 4)
    others = [
        SampleRandom(2).uniform(0, range(100), 4),
        SampleRandom(1).uniform(1, range(100), 4),
        SampleRandom(1).uniform(0, range(100), 4, stream=1),
        SampleRandom(1).uniform(0, range(100, 200), 4),
        SampleRandom(1 << 32).uniform(0, range(100), 4),  # the high word of the seed matters
    ]
    for other in others:
        assert not np.any(np.isclose(base, other)), "streams that should be independent coincide"


def test_distributions_look_right():
    streams = SampleRandom(12345)
    u = streams.uniform(0, range(200_000), 4)
    assert u.min() >= 0.0 and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 0.003 and abs(u.var() - 1 / 12) < 0.002
    histogram = np.histogram(u, bins=20, range=(0, 1))[0] / u.size
    assert np.allclose(histogram, 0.05, atol=0.002)
    neighbours = np.corrcoef(u[:-1, 0], u[1:, 0])[0, 1]  # consecutive sample ids
    assert abs(neighbours) < 0.01
    z = streams.normal(0, range(200_000), 3)
    assert z.shape == (200_000, 3) and abs(z.mean()) < 0.01 and abs(z.std() - 1) < 0.01
    assert abs((np.abs(z) < 1.96).mean() - 0.95) < 0.003
    k = streams.integers(0, range(60_000), 2, low=-3, high=3)
    assert k.min() == -3 and k.max() == 2
    assert np.allclose(np.bincount((k + 3).ravel()) / k.size, 1 / 6, atol=0.01)


def test_streaming_has_bounded_chunks_and_same_values():
    streams = SampleRandom(5)
    whole = streams.uniform(2, range(10_000), 3)
    chunks = list(streams.iter_uniform(2, range(10_000), 3, chunk=4096))
    assert [len(c) for c in chunks] == [4096, 4096, 1808]
    assert np.array_equal(np.concatenate(chunks), whole)
    generated = list(streams.iter_uniform(2, (i for i in range(10_000) if i % 3 == 0), 3, chunk=1000))
    assert np.array_equal(np.concatenate(generated), whole[::3])


def test_empty_inputs():
    streams = SampleRandom(0)
    assert streams.uniform(0, [], 3).shape == (0, 3)
    assert streams.uniform(0, range(4), 0).shape == (4, 0)
    assert streams.normal(0, range(4), 1).shape == (4, 1)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda s: SampleRandom(-1), "seed must be an integer"),
        (lambda s: SampleRandom(2**64), "seed must be an integer"),
        (lambda s: s.uniform(-1, [0], 1), "epoch must be an integer"),
        (lambda s: s.uniform(2**32, [0], 1), "epoch must be an integer"),
        (lambda s: s.uniform(0, [-5], 1), "sample ids must be non-negative"),
        (lambda s: s.uniform(0, [1.5], 1), "sample ids must be integers"),
        (lambda s: s.uniform(0, [[1, 2]], 1), "one-dimensional"),
        (lambda s: s.uniform(0, [1], -1), "count must be a non-negative integer"),
        (lambda s: s.uniform(0, [1], 1, stream=256), "stream must be an integer"),
        (lambda s: s.integers(0, [1], 1, low=3, high=3), "high > low"),
        (lambda s: list(s.iter_uniform(0, range(3), 1, chunk=0)), "chunk must be at least 1"),
    ],
)
def test_bad_input_is_named(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call(SampleRandom(1))
