"""Ranks at different collective calls on one communicator (a branch on the rank around a library call) end the job
with one CollectiveMismatch naming each rank's call and line, whichever calls met: blocking or awaited, the library's
entries, its file objects' calls and the runtime's collectives all begin with the same checked exchange."""

from pathlib import Path

import pytest
from helpers import run_mpi

_PROGRAM = Path(__file__).parent / "programs" / "crossed_calls.py"
_APART = "the ranks of its communicator came to different collective calls"
_SAME_ORDER = "each rank of the comm given must make the same collective calls on it, in the same order"


def _at(text: str) -> str:
    """``crossed_calls.py:N``, N the first line of the program that holds ``text``."""
    lines = _PROGRAM.read_text().splitlines()
    return f"crossed_calls.py:{next(number for number, line in enumerate(lines, 1) if text in line)}"


def _said(pair: str, directory: Path, first: str, second: str) -> str:
    """The mismatch every rank raises for ``pair``, the ranks of each half named ``first`` and ``second``."""
    made_b, made_a = f"RowWriter({directory / 'b.h5'})", f"RowWriter({directory / 'a.h5'})"
    writer = f"{made_b}, at {_at('        RowWriter(DIRECTORY')}"
    if pair == "writer/dataset":
        dataset = f"ShardedDataset({directory / 'c.h5'}), at {_at('with ShardedDataset(')}"
        return f"{made_b}: {_APART}: {first}: {writer}; {second}: {dataset}; {_SAME_ORDER}"
    if pair == "writer/other_writer":
        other = f"RowWriter({directory / 'd.h5'}), at {_at('(another file)')}"
        return f"{made_b}: {_APART}: {first}: {writer}; {second}: {other}; {_SAME_ORDER}"
    if pair == "agree/on_rank_0":
        agreed, asked = _at("agree(comm, None"), _at("on_rank_0(comm, os.getcwd)")
        return (f"agree(checking the inputs): {_APART}: {first}: agree(checking the inputs), at {agreed}; {second}: "
                f"on_rank_0(getcwd), at {asked}; {_SAME_ORDER}")  # fmt: skip
    if pair == "allreduce/writer":
        return (f"collective #1 on world: the ranks called different collectives, or passed different arguments "
                f"(shape, dtype, op, root), where all must call the same: {first}: allreduce(float64(4,) sum) at "
                f"{_at('await system.world.allreduce')}; {second}: {writer}")  # fmt: skip
    return (f"{made_b}: {_APART}: {first}: {made_b}, at {_at('(a second writer)')}; {second}: {made_a}.close, "
            f"its call 2 on it, at the program's end (it never closed the writer); {_SAME_ORDER}")  # fmt: skip


@pytest.mark.parametrize(
    "ranks, pair, how",
    [
        (2, "writer/dataset", "plain"),
        (2, "writer/dataset", "run"),
        (4, "writer/dataset", "run"),
        (2, "writer/other_writer", "plain"),
        (2, "writer/other_writer", "run"),
        (2, "agree/on_rank_0", "plain"),
        (4, "agree/on_rank_0", "plain"),
        (2, "agree/on_rank_0", "run"),
        (2, "allreduce/writer", "run"),
        (2, "unclosed/writer", "plain"),
        (4, "unclosed/writer", "plain"),
    ],
)
def test_ranks_at_different_collective_calls_on_one_communicator_raise_one_mismatch_naming_each(
    tmp_path, ranks, pair, how
):
    """Before, per pair: a writer made and a data set opened let each other past their entries (two barriers met)
    and every rank waited in the two opens' collectives for ever (killed at 25 s, plain), as did two writers made of
    two files (their entries told apart by kind alone until they were by the files' real paths); ``agree`` and
    ``on_rank_0`` met, and the ranks in ``agree`` went on as if agreed while the others failed with
    MPI_ERR_TRUNCATE; an awaited allreduce against a writer made, and a writer's close at the program's end against
    another writer made, failed with MPI_ERR_TRUNCATE, naming neither call."""
    job = run_mpi("crossed_calls.py", ranks, str(tmp_path), pair, how, timeout=60,
                  env={"MPISCALE_COLLECTIVE_CHECK_S": "1"})  # fmt: skip
    assert job.returncode != 0 and job.elapsed < 30, job.output[-3000:]
    half = ranks // 2
    first, second = ("rank 0", "rank 1") if ranks == 2 else (f"ranks 0-{half - 1}", f"ranks {half}-{ranks - 1}")
    said = _said(pair, tmp_path, first, second)
    assert f"CollectiveMismatch: {said}" in job.stderr, job.stderr[-3000:]
    assert "MPI_ERR" not in job.output and "rank 0 done" not in job.stdout, job.output[-3000:]
    if how == "run":
        assert job.stderr.count("job failed on rank") == 1, job.stderr[-3000:]
    assert not any((tmp_path / name).exists() for name in ("b.h5", "b.h5.tmp", "d.h5", "d.h5.tmp"))
