"""Ragged data sets as users store them, and the batching strategies over them (one process)."""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from mpiscale.io import (
    Batching,
    DataFileError,
    RaggedDataset,
    SampleRandom,
    SampleReader,
    ShardedDataset,
    open_arrays,
)
from mpiscale.io.batching import EpochBatches, SampleSizes

SAMPLES = 257


def _sequences(samples: int = SAMPLES, seed: int = 0, shortest: int = 1, longest: int = 40) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1000, n).astype(np.int32) for n in rng.integers(shortest, longest + 1, samples)]


def _write_layouts(path, rows: list[np.ndarray]) -> None:
    """The same sequences three ways, as h5py users write them: variable-length, values + starts, values + N+1
    boundaries (compressed and chunked, as a careful user stores big data)."""
    lengths = np.array([len(r) for r in rows])
    edges = np.concatenate([[0], np.cumsum(lengths)])
    with h5py.File(path, "w") as file:
        vlen = file.create_dataset("vlen", (len(rows),), dtype=h5py.vlen_dtype(np.int32))
        for index, row in enumerate(rows):
            vlen[index] = row
        file["values"] = np.concatenate(rows)
        file["starts"] = edges[:-1]
        file.create_dataset("packed", data=np.concatenate(rows), chunks=(97,), compression="gzip")
        file["edges"] = edges.astype(np.uint32)
        file["labels"] = np.arange(len(rows)) % 5


@pytest.mark.parametrize(
    "name, offsets", [("vlen", ""), ("values", "starts"), ("packed", "/edges")], ids=["vlen", "starts", "edges"]
)
def test_every_layout_reads_the_sequences_the_user_wrote(tmp_path, name, offsets):
    rows = _sequences()
    _write_layouts(tmp_path / "data.h5", rows)
    with RaggedDataset(tmp_path / "data.h5", name, offsets) as data:
        assert len(data) == SAMPLES and data.dtype == np.int32
        assert np.array_equal(data.lengths, [len(r) for r in rows])
        ids = np.array([0, 1, 2, 50, 51, 200, SAMPLES - 1])
        batch = data.read(ids)
        for at, sample in enumerate(ids):
            assert np.array_equal(batch.row(at), rows[sample])
        padded = batch.padded(-1)
        assert padded.shape == (len(ids), max(len(rows[i]) for i in ids))
        assert np.array_equal(padded[3, : len(rows[50])], rows[50]) and (padded[3, len(rows[50]) :] == -1).all()


def test_npy_pairs_and_several_files_with_their_own_offsets(tmp_path):
    rows = _sequences()
    halves = [rows[:100], rows[100:]]
    for part, chunk in enumerate(halves):
        _write_layouts(tmp_path / f"part-{part}.h5", chunk)
    with RaggedDataset(str(tmp_path / "part-*.h5"), "values", "starts") as data:  # each file counts its own values
        assert len(data) == SAMPLES
        batch = data.read(np.array([98, 99, 100, 101]))  # across the files' border
        for at, sample in enumerate([98, 99, 100, 101]):
            assert np.array_equal(batch.row(at), rows[sample])
    np.save(tmp_path / "values.npy", np.concatenate(rows))
    np.save(tmp_path / "offsets.npy", np.concatenate([[0], np.cumsum([len(r) for r in rows])]))
    with RaggedDataset(tmp_path / "values.npy", offsets=str(tmp_path / "offsets.npy")) as data:
        assert np.array_equal(data.read(np.array([SAMPLES - 1])).row(0), rows[-1])


def test_sequences_stored_big_endian_read_as_written_beside_little_endian_ones(tmp_path):
    """Token sequences from a big-endian tool: h5py hands a variable-length row of ``>i4`` numbers with the file's
    bytes under a native dtype, so a token 1 read as 16,777,216 (the same from a file a C program wrote), and a
    second file in this machine's order was refused as of another dtype. Values with their offsets in either order
    (and a .npy) read as written too."""
    rows = _sequences(40)
    other = np.dtype(np.int32).newbyteorder("S")
    with h5py.File(tmp_path / "a.h5", "w") as file:
        vlen = file.create_dataset("tokens", (20,), dtype=h5py.vlen_dtype(other))
        for index, row in enumerate(rows[:20]):
            vlen[index] = row.astype(other)
        file["values"] = np.concatenate(rows[:20]).astype(other)
        file["starts"] = np.concatenate([[0], np.cumsum([len(r) for r in rows[:19]])]).astype(">i8")
    with h5py.File(tmp_path / "b.h5", "w") as file:
        vlen = file.create_dataset("tokens", (20,), dtype=h5py.vlen_dtype(np.int32))
        for index, row in enumerate(rows[20:]):
            vlen[index] = row
        file["values"] = np.concatenate(rows[20:])
        file["starts"] = np.concatenate([[0], np.cumsum([len(r) for r in rows[20:39]])])
    for files, (name, offsets) in itertools.product(["a.h5", "*.h5"], [("tokens", ""), ("values", "starts")]):
        with RaggedDataset(str(tmp_path / files), name, offsets) as data:
            batch = data.read(np.arange(len(data)))
            assert data.dtype == np.int32 and data.dtype.isnative and batch.values.dtype.isnative
            assert np.array_equal(data.lengths, list(map(len, rows[: len(data)])))
            for sample in range(len(data)):
                assert np.array_equal(batch.row(sample), rows[sample]), (files, name, sample, batch.row(sample)[:3])


def test_bad_indexes_and_layouts_are_refused_naming_the_problem(tmp_path):
    path = tmp_path / "bad.h5"
    with h5py.File(path, "w") as file:
        file["values"] = np.arange(10)
        file["falling"] = [0, 4, 3]
        file["outside"] = [0, 4, 11]
        file["floats"] = [0.0, 4.0]
        file["words"] = np.array(["a", "bc"], dtype=h5py.string_dtype())
        file["late"] = [3, 5, 8]  # starts that skip values 0-2: read, they would silently drop them
    with pytest.raises(DataFileError, match="offsets must begin at 0, .* begin at 3: values 0 .. 2 would belong to no"):
        RaggedDataset(path, "values", "late")
    with pytest.raises(DataFileError, match="offset 2 is 3, after 4"):
        RaggedDataset(path, "values", "falling")
    with pytest.raises(DataFileError, match="offset 2 is 11, outside 0 .. 10"):
        RaggedDataset(path, "values", "outside")
    with pytest.raises(DataFileError, match="offsets must be one row of integers"):
        RaggedDataset(path, "values", "floats")
    with pytest.raises(DataFileError, match="fixed rows .* name the index with --offsets"):
        RaggedDataset(path, "values")
    with pytest.raises(DataFileError, match="holds no data set 'missing'|missing"):
        RaggedDataset(path, "values", "missing")


def _sizes(rows: list[np.ndarray]) -> SampleSizes:
    return SampleSizes(np.array([[len(r)] for r in rows]), np.array([4]), 8)


@pytest.mark.parametrize("strategy", ["sequential", "round-robin", "memory"])
def test_each_strategy_serves_every_sample_once_and_the_batches_do_not_depend_on_the_world_size(strategy):
    sizes = _sizes(_sequences())
    batching = Batching(strategy, batch_size=24, batch_bytes=1200)
    one = EpochBatches(sizes, batching, 3, 7, True, 64)
    for ranks in (2, 3):
        plans = [EpochBatches(sizes, batching, 3, 7, True, 64, ranks, rank) for rank in range(ranks)]
        assert len({plan.steps for plan in plans}) == 1
        served = [plan.batch(step) for step in range(plans[0].steps) for plan in plans]
        assert np.array_equal(np.sort(np.concatenate(served)), np.arange(SAMPLES))
        for batch in served:
            assert (np.diff(batch) > 0).all()  # ascending: reads run over consecutive samples
        if strategy == "memory":  # the same batches, P of them a step
            assert [b.tolist() for b in served if len(b)] == [one.batch(s).tolist() for s in range(one.steps)]
        else:  # the same global batches, each split over the ranks
            for step in range(one.steps):
                assert np.array_equal(np.sort(np.concatenate([p.batch(step) for p in plans])), one.batch(step))
    if strategy == "memory":
        assert all(sizes.padded(one.batch(s)) <= 1200 for s in range(one.steps))
    again = EpochBatches(sizes, batching, 3, 7, True, 64)
    other_epoch = EpochBatches(sizes, batching, 4, 7, True, 64)
    assert [again.batch(s).tolist() for s in range(again.steps)] == [one.batch(s).tolist() for s in range(one.steps)]
    assert [other_epoch.batch(s).tolist() for s in range(other_epoch.steps)] != [
        one.batch(s).tolist() for s in range(one.steps)
    ]


def test_memory_batching_groups_sizes_and_cuts_padding(tmp_path):
    rows = _sequences(2000, longest=400, shortest=40)
    _write_layouts(tmp_path / "data.h5", rows)

    def padding(batching: Batching) -> float:
        with SampleReader(open_arrays(tmp_path / "data.h5", ["values"], {"values": "starts"}), batching,
                          shuffle=True) as reader:  # fmt: skip
            for _ in reader.epoch(0):
                pass
            return reader.stats.padding_share

    fixed, grouped = padding(Batching("sequential", batch_size=64)), padding(Batching("memory", batch_bytes=64 << 10))
    assert fixed > 0.3 and grouped < 0.05, (fixed, grouped)


def test_per_sample_random_numbers_are_the_same_whatever_the_strategy(tmp_path):
    rows = _sequences()
    _write_layouts(tmp_path / "data.h5", rows)
    streams, drawn = SampleRandom(11), {}
    for batching in (Batching("sequential", batch_size=10), Batching("memory", batch_bytes=2000),
                     Batching("adaptive", memory_bytes=40_000)):  # fmt: skip
        with SampleReader(open_arrays(tmp_path / "data.h5", ["vlen", "labels"], {"vlen": ""}), batching,
                          shuffle=True, seed=5) as reader:  # fmt: skip
            values = {}
            for batch in reader.epoch(2):
                assert np.array_equal(batch.data["labels"], batch.ids % 5)
                for sample, numbers in zip(batch.ids.tolist(), streams.uniform(2, batch.ids, 3)):
                    values[sample] = numbers.tolist()
            drawn[batching.strategy] = values
    assert sorted(drawn["adaptive"]) == list(range(SAMPLES))
    assert drawn["sequential"] == drawn["memory"] == drawn["adaptive"]


def test_a_budget_that_cannot_hold_one_sample_is_refused(tmp_path):
    rows = _sequences()
    _write_layouts(tmp_path / "data.h5", rows)
    longest = int(np.argmax([len(r) for r in rows]))
    with pytest.raises(ValueError, match=f"sample {longest} takes 160 bytes, more than batch_bytes \\(100\\)"):
        SampleReader(open_arrays(tmp_path / "data.h5", ["values"], {"values": "starts"}), Batching("memory",
                     batch_bytes=100))  # fmt: skip
    with pytest.raises(ValueError, match="raise memory_bytes to at least 320"):
        SampleReader(open_arrays(tmp_path / "data.h5", ["values"], {"values": "starts"}), Batching("adaptive",
                     memory_bytes=300))  # fmt: skip


@pytest.mark.parametrize("strategy", ["memory", "adaptive"])
def test_the_reader_never_holds_more_than_its_budget_while_the_caller_is_slow(tmp_path, strategy):
    rows = _sequences(3000, longest=300)
    _write_layouts(tmp_path / "data.h5", rows)
    # the reader's own index and plan of 3,000 samples (about 0.2 MB) count within the budget
    batching = Batching(strategy, batch_bytes=20_000, prefetch_bytes=250_000, memory_bytes=270_000)
    with SampleReader(open_arrays(tmp_path / "data.h5", ["values"], {"values": "starts"}), batching,
                      shuffle=True) as reader:  # fmt: skip
        limit, apart = reader.limit(reader.plan(0)), reader.held_apart(reader.plan(0))
        served = 0
        for index, batch in enumerate(reader.epoch(0)):
            served += len(batch.ids)
            if index % 10 == 0:
                os.sched_yield()
        assert served == 3000
        assert 100_000 < apart < 250_000 and limit == 270_000 - apart and 0 < reader.stats.peak_held <= limit
    with pytest.raises(ValueError, match="beside the reader.s own index and plan"):
        SampleReader(open_arrays(tmp_path / "data.h5", ["values"], {"values": "starts"}),
                     Batching(strategy, batch_bytes=20_000, prefetch_bytes=60_000, memory_bytes=80_000))  # fmt: skip


def test_process_memory_stays_within_the_budget_reading_a_file_eight_times_larger(tmp_path):
    """The process's VmHWM above its size before reading, not only the reader's count: 64 MiB read with 8 MiB."""
    path = tmp_path / "big.h5"
    rng = np.random.default_rng(0)
    lengths = rng.integers(2000, 20000, 1500)
    with h5py.File(path, "w") as file:
        file.create_dataset("values", data=np.ones(int(lengths.sum()), np.float32))
        file["starts"] = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    program = f"""
import sys
from mpiscale.io import Batching, SampleReader, open_arrays, epoch_order
from mpiscale.bench.batching import _status_kib
epoch_order(8, 0, 0, True)
base = _status_kib("VmRSS")
with SampleReader(open_arrays({str(path)!r}, ["values"], {{"values": "starts"}}),
                  Batching("memory", batch_bytes=4 << 20, prefetch_bytes=(4 << 20) + 200_000), shuffle=True) as reader:
    total = sum(batch.nbytes for batch in reader.epoch(0))
print(total, (_status_kib("VmHWM") - base) * 1024)
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120, check=True)
    total, grown = map(int, done.stdout.split())
    assert total == lengths.sum() * 4 > 8 * (8 << 20)
    assert grown <= (8 << 20) + (5 << 20), f"grew {grown / 2**20:.1f} MiB for an 8 MiB budget"


def test_the_budget_holds_the_readers_own_index_and_plan_and_refuses_a_read_ahead_they_leave_no_room_in(tmp_path):
    """63,000 short samples: their index and plan take megabytes, which the budget counts (at 16 MiB they once
    took it to 1.3x). A read-ahead that holds a batch but not them as well is refused, naming their size."""
    path = tmp_path / "many.h5"
    lengths = np.random.default_rng(1).integers(1, 64, 63_000)
    with h5py.File(path, "w") as file:
        file.create_dataset("values", data=np.ones(int(lengths.sum()), np.int32))
        file["starts"] = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    arrays = {"values": "starts"}
    with pytest.raises(ValueError, match=r"\(1,048,576 bytes, at most\) beside the reader's own index and plan \(\d"):
        SampleReader(open_arrays(path, ["values"], arrays), Batching("memory", batch_bytes=1 << 20,
                                                                      prefetch_bytes=2 << 20))  # fmt: skip
    with SampleReader(open_arrays(path, ["values"], arrays), Batching("memory", batch_bytes=1 << 20,
                                                                       prefetch_bytes=12 << 20)) as reader:  # fmt: skip
        plan = reader.plan(0)
        apart = reader.held_apart(plan)
        assert 2 << 20 < apart < 12 << 20 and reader.limit(plan) == (13 << 20) - apart
        assert (
            sum(len(batch.ids) for batch in reader.epoch(0)) == 63_000 and reader.stats.peak_held <= (13 << 20) - apart
        )


def test_a_read_that_fails_ends_the_epoch_with_the_error_and_leaving_early_stops_the_reader(tmp_path):
    rows = _sequences(2000, longest=300)
    _write_layouts(tmp_path / "data.h5", rows)
    with SampleReader(open_arrays(tmp_path / "data.h5", ["values"], {"values": "starts"}),
                      Batching("memory", batch_bytes=8000), shuffle=True) as reader:  # fmt: skip
        for index, _ in enumerate(reader.epoch(0)):
            if index == 3:
                break  # the reader thread stops; a second epoch starts cleanly
        assert sum(len(batch.ids) for batch in reader.epoch(1)) == 2000
        os.truncate(tmp_path / "data.h5", 4096)  # the disk under the file is gone
        with pytest.raises(DataFileError, match="truncated"):
            for _ in reader.epoch(2):
                pass


def test_a_reader_of_rows_of_one_size_refuses_variable_length_rows_naming_the_ragged_reader(tmp_path):
    _write_layouts(tmp_path / "data.h5", _sequences())
    with pytest.raises(DataFileError, match="holds variable-length rows .* read by RaggedDataset"):
        ShardedDataset(tmp_path / "data.h5", "vlen")


def test_an_awaited_epoch_given_up_midway_closes_at_once(tmp_path):
    """The event loop's way: batches awaited, the epoch abandoned after two; the reader closes without a hang."""
    _write_layouts(tmp_path / "data.h5", _sequences(2000, longest=300))

    async def two_then_leave(reader: SampleReader) -> int:
        epoch = reader.aepoch(0)
        first, second = await epoch.__anext__(), await epoch.__anext__()
        await epoch.aclose()
        return len(first.ids) + len(second.ids)

    reader = SampleReader(open_arrays(tmp_path / "data.h5", ["values"], {"values": "starts"}),
                          Batching("memory", batch_bytes=4000), shuffle=True)  # fmt: skip
    started = time.perf_counter()
    assert asyncio.run(two_then_leave(reader)) > 0
    reader.close()
    assert time.perf_counter() - started < 10


def test_a_caller_that_keeps_every_batch_is_told_so_instead_of_waiting_forever(tmp_path):
    _write_layouts(tmp_path / "data.h5", _sequences(2000, longest=300))
    with SampleReader(open_arrays(tmp_path / "data.h5", ["values"], {"values": "starts"}),
                      Batching("memory", batch_bytes=4000), shuffle=True) as reader:  # fmt: skip
        kept = []
        started = time.perf_counter()
        with pytest.raises(MemoryError, match="held by batches the caller keeps .* copy what you keep"):
            for batch in reader.epoch(0):
                kept.append(batch)  # never dropped: the budget (12,000 bytes) fills
        assert 2 <= len(kept) <= 4 and time.perf_counter() - started < 10
        kept.clear()
        assert sum(len(batch.ids) for batch in reader.epoch(1)) == 2000  # once dropped, reading goes on
