"""The room a RowWriter sets aside for a growing data set (one process): its chunks whole as they grow, counted once
when a resumed run cuts rows back and grows again, and what stays unused given back at the close."""

import os

import numpy as np

from mpiscale.io import RowWriter, read_dataset

ROW = 1024  # float64 values a row: 8 KiB, so a chunk (1 MiB) holds 128 rows


def _allocated(path) -> int:
    return os.stat(path).st_blocks * 512


def test_a_growing_data_set_has_its_chunks_room_set_aside_once_and_the_rest_given_back(tmp_path):
    out = tmp_path / "x.h5"
    writer = RowWriter(out, {"x": ((0, ROW), np.float64)}, growing=("x",))
    made = _allocated(writer.temporary)
    writer.grow({"x": 129})  # two chunks: the second holds one row
    grown = _allocated(writer.temporary)
    assert grown - made >= 2 << 20, (made, grown)  # (before any row is written)
    writer.grow({"x": 64})  # cut back, as a resumed run does, then grown past where it was
    writer.grow({"x": 256})
    assert _allocated(writer.temporary) == grown, "the rows cut back and grown again were counted twice"
    writer.write(0, {"x": np.arange(256 * ROW, dtype=np.float64).reshape(256, ROW)})
    writer.grow({"x": 300})  # a third chunk, left unwritten at the close
    assert _allocated(writer.temporary) >= grown + (1 << 20)
    writer.grow({"x": 256})
    writer.close()
    written = os.stat(out)
    assert written.st_blocks * 512 < written.st_size + (64 << 10), written  # (the third chunk's room given back)
    assert (read_dataset(out, "x") == np.arange(256 * ROW).reshape(256, ROW)).all()
