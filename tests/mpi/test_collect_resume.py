"""`mpiscale collect` over more than one run: a stopped and a killed run resumed on other numbers of ranks, and what
a resumed run must refuse (another model's weights, inputs written again, other settings)."""

import shutil

import h5py
import numpy as np
import pytest
from helpers import assert_ok, finish, held_at_step, interrupt, launch, run_alone
from test_train import MPISCALE, mpiscale


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(a model trained on one rank for an epoch, its inputs: the bundled digits, 1,437 rows)."""
    model = tmp_path_factory.mktemp("trained") / "model.h5"
    assert_ok(mpiscale(1, "train", "--epochs", 1, "--hidden", "16", "--progress-every", 0, "--out", model))
    return model, model.with_name("model.digits.h5")


def _activations(path) -> tuple[np.ndarray, np.ndarray]:
    with h5py.File(path, "r") as file:
        return file["relu1"][()], file["sample_ids"][()]


def _nudged(path, name: str, index: tuple) -> None:
    """One value of ``path``'s data set ``name`` made the next float up."""
    with h5py.File(path, "r+") as file:
        file[name][index] = np.nextafter(file[name][index], np.inf)


def test_a_stopped_and_a_killed_run_go_on_from_their_last_round_on_other_rank_counts(trained, tmp_path):
    """SIGTERM, then SIGKILL of one rank, 100 rounds in: the rows collected stay in OUT.partial or OUT.tmp, inspect
    says how far they go, a plain run is refused, and --resume on 3 ranks and on 1 collects the rest as one
    uninterrupted run does. A resume with the model trained again, one input value written again among the rows
    collected, or other layers, is refused and leaves the kept file as it was: it would have mixed other rows in."""
    model, data = tmp_path / "model.h5", tmp_path / "inputs.h5"
    shutil.copyfile(trained[0], model)
    shutil.copyfile(trained[1], data)  # 1,437 rows: 719 rounds of 2
    rows = 1437
    common = ["collect", "--model", str(model), "--data", f"{data}:/inputs", "--layers", "relu1"]
    whole = tmp_path / "whole.h5"
    assert_ok(mpiscale(1, *common, "--out", whole, "--batch-size", 500))
    expected, ids = _activations(whole)
    for way, then in (("stopped", 3), ("killed", 1)):
        out, log = tmp_path / f"{way}.h5", tmp_path / f"{way}.log"
        with open(log, "w") as stdout:
            process = launch(2, [*MPISCALE, *common, "--out", str(out), "--batch-size", "1", "--progress-every",
                                 "0.001"], stdout=stdout)  # fmt: skip
            with held_at_step(process, log, str(out), "round", 100) as (ranks, _):  # (the first round is marked)
                interrupt(ranks, way)
            ended = finish(process, f"collect {way}", 60)
        kept = tmp_path / (f"{way}.h5.partial" if way == "stopped" else f"{way}.h5.tmp")
        assert ended.returncode != 0 and kept.exists() and not out.exists(), ended.output[-3000:]
        with h5py.File(kept, "r") as file:
            done = int(file.attrs["rows_done"])
        assert 0 < done < rows, done
        shown = run_alone("inspect", kept)
        assert_ok(shown)
        assert f"rows: {done:,} of {rows:,} collected; mpiscale collect --resume --out {out}," in shown.stdout, (
            shown.stdout)  # fmt: skip
        if way == "killed":  # learning from its layer took the rows after the mark (zeros) for activations
            learn = run_alone("dictlearn", "--data", f"{kept}:/relu1", "--atoms", "4", "--out", tmp_path / "d.h5")
            refusal = (
                f"holds {done:,} of its 1,437 rows, an unfinished run's (the others hold nothing yet): "
                f"mpiscale collect --resume --out {out},"
            )
            assert learn.returncode == 2 and refusal in learn.stderr, learn.stderr
        before = kept.read_bytes()
        plain = mpiscale(2, *common, "--out", out)
        said = plain.stderr.splitlines()
        assert plain.returncode == 2 and "pass --resume" in said[-1], plain.stderr
        assert len(said) == 1 or (way == "killed" and len(said) == 2 and "taking over the lock" in said[0]), said
        if way == "stopped":
            for changed, name, index, refusal in [
                (model, "model/hidden1.weight", (3, 5), "model weights: stopped run "),
                (data, "inputs", (done - 1, 20), f"the first {done:,} rows, which the earlier run collected, hold "),
            ]:  # fmt: skip
                _nudged(changed, name, index)
                refused = mpiscale(2, *common, "--out", out, "--resume")
                assert refused.returncode == 2 and refusal in refused.stderr, refused.stderr
                shutil.copyfile(trained[0] if changed == model else trained[1], changed)
            other = mpiscale(2, *[*common[:-1], "hidden1,relu1"], "--out", out, "--resume")
            assert other.returncode == 2 and "layers: stopped run ['relu1'], now ['hidden1', 'relu1']" in other.stderr
        assert kept.read_bytes() == before  # refused runs leave the kept rows as they were
        resumed = mpiscale(then, *common, "--out", out, "--resume", "--batch-size", 7)
        assert_ok(resumed)
        assert f"resumed from {kept}: {done:,} of {rows:,} rows were collected" in resumed.stdout, resumed.stdout
        got, got_ids = _activations(out)
        assert np.array_equal(got_ids, ids) and not kept.exists()
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_inputs_of_fewer_rows_than_ranks_a_file_of_before_the_marks_and_one_cut_off(trained, tmp_path):
    """Edges of the rounds: inputs of fewer rows than ranks leave a rank no row in every round; an activations file
    of before the marks (no rows_done) is taken as complete by inspect; an OUT.tmp cut off before its first mark
    (a kill as it was made) is refused as such, and left for the user to remove."""
    data = tmp_path / "three.h5"
    with h5py.File(trained[1], "r") as source, h5py.File(data, "w") as file:
        file["x"] = source["inputs"][:3]
    out = tmp_path / "a.h5"
    assert_ok(mpiscale(4, "collect", "--model", trained[0], "--data", f"{data}:/x", "--out", out))
    got, ids = _activations(out)
    assert got.shape[0] == 3 and ids.tolist() == [0, 1, 2]
    with h5py.File(out, "r+") as file:
        del file.attrs["rows_done"]
    shown = run_alone("inspect", out)
    assert_ok(shown)
    assert "collected; mpiscale collect --resume" not in shown.stdout and "learn a dictionary" in shown.stdout, (
        shown.stdout)  # fmt: skip
    cut = tmp_path / "c.h5.tmp"
    cut.write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(100))  # a superblock's first bytes, then nothing
    refused = mpiscale(2, "collect", "--model", trained[0], "--data", f"{data}:/x", "--out", tmp_path / "c.h5",
                       "--resume")  # fmt: skip
    assert refused.returncode == 2 and "cannot be resumed: it was cut off" in refused.stderr, refused.stderr
    assert cut.exists() and not (tmp_path / "c.h5").exists()
