"""What needs no MPI job: row blocks per rank, message pieces, message tags and frames."""

import numpy as np
import pytest

from mpiscale.ranks import block_rows, chunks, rank_rows
from mpiscale.runtime import transport


@pytest.mark.parametrize("total, parts", [(0, 3), (2, 4), (9, 4), (10, 5), (1001, 7)])
def test_block_rows_splits_like_numpy(total, parts):
    assert block_rows(total, parts) == [len(b) for b in np.array_split(np.empty(total), parts)]


def test_chunks_cover_the_buffer_exactly():
    data = memoryview(bytes(range(256)) * 40)
    pieces = list(chunks(data, 1000))
    assert [p.nbytes for p in pieces] == [1000] * 10 + [240]
    assert b"".join(pieces) == data.tobytes()
    assert [p.nbytes for p in chunks(memoryview(b""), 10)] == [0]


def test_data_tags_stay_within_the_tag_bound():
    assert all(2 <= transport.data_tag(seq, 32767) <= 32767 for seq in (0, 1, 32765, 32766, 10**9))


@pytest.mark.parametrize("frame", [b"", b"XXXXYYYYZZZZWWWW", b"MPSC"])
def test_foreign_frames_are_rejected(frame):
    with pytest.raises(transport.TransportError):
        transport.decode_frame(memoryview(frame))


def test_truncated_inline_frame_is_rejected():
    encoded = transport.encode(np.arange(100), seq=1, inline_bytes=65536)
    with pytest.raises(transport.TransportError):
        transport.decode_frame(memoryview(encoded.frame[:-8]))


def test_buffer_pool_reuses_only_unreferenced_buffers():
    pool = transport.BufferPool(max_bytes=64 << 20)
    size = 2 << 20
    first = pool.take(size)
    in_use = np.frombuffer(first, dtype=np.float64)  # user code keeps a view
    del first
    second = pool.take(size)
    assert not np.shares_memory(np.frombuffer(second, np.uint8), in_use), "handed out a buffer still in use"
    del second
    # an array rebuilt by unpickling keeps its buffer busy too
    parts = transport.serialize(np.arange(size // 8, dtype=np.float64))
    buffer = pool.take(parts[1].nbytes)
    buffer[:] = parts[1]
    received = transport.deserialize([parts[0], buffer])
    del buffer
    third = pool.take(size)
    assert not np.shares_memory(np.frombuffer(third, np.uint8), received)
    assert not np.shares_memory(np.frombuffer(third, np.uint8), in_use)
    held = pool._held
    del third, received, in_use
    again = pool.take(size)
    assert pool._held == held, "a free buffer was not reused"
    assert np.frombuffer(again, np.uint8).nbytes == size


def test_buffer_pool_respects_its_limit():
    pool = transport.BufferPool(max_bytes=5 << 20)
    taken = [pool.take(2 << 20) for _ in range(4)]  # 8 MiB in use, only 4 MiB may be pooled
    assert pool._held <= 5 << 20 and len(taken) == 4
    del taken
    pool.take(3 << 20)  # frees the unreferenced ones to make room
    assert pool._held <= 5 << 20


def test_rank_rows_tile_the_rows_in_rank_order():
    ranges = [rank_rows(1001, 7, rank) for rank in range(7)]
    assert ranges[0][0] == 0 and ranges[-1][1] == 1001
    assert all(stop == start for (_, stop), (start, _) in zip(ranges, ranges[1:]))
