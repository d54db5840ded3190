"""Checkpointer in one process (MPI singleton): argument checks, round trip, retention, missing steps."""

import json

import numpy as np
import pytest
from mpi4py import MPI

from mpiscale.io import Checkpointer, CheckpointError


@pytest.fixture
def checkpoints(tmp_path):
    with Checkpointer(tmp_path / "ckpt", MPI.COMM_SELF, keep=2) as made:
        yield made


def test_nothing_to_load_is_none_but_a_missing_step_is_an_error(checkpoints):
    assert checkpoints.load() is None and checkpoints.steps() == []
    with pytest.raises(CheckpointError, match="no checkpoint of step 5"):
        checkpoints.load(5)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"sharded": {"x": [1, 2]}}, "'x' is a list, not a numpy array"),
        ({"sharded": {"x": np.array([object()])}}, "holds Python objects"),
        ({"sharded": {"x": np.float64(1.0)}}, "is a float64, not a numpy array"),
        ({"sharded": {"x": np.array(1.0)}}, "needs at least one dimension"),
        ({"sharded": {"a/b": np.zeros(2)}}, "without '/'"),
        ({"sharded": {"x": np.zeros(2)}, "replicated": {"x": np.zeros(2)}}, "both sharded and replicated"),
        ({"meta": {"when": object()}}, "meta is not JSON-serializable"),
        # these failed in the write itself, leaving step-00000001.h5.tmp: refused now before any file is made
        ({"sharded": {"x": np.array(["ab", "c"])}}, r"'x' is <U2, which HDF5 cannot store; store bytes"),
        ({"replicated": {"t": np.array(["2026-12-04"], "M8[D]")}}, "'t' is datetime64.D., which HDF5 cannot"),
        ({"replicated": {"r": np.zeros(2, [("a", "f8"), ("b", "i2")])}}, "'r' is an array of records"),
    ],
)
def test_bad_arguments_are_refused(checkpoints, arguments, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        checkpoints.save(1, **arguments)
    assert not list((tmp_path / "ckpt").glob("step-*"))


def test_round_trip_retention_and_step_order(checkpoints, tmp_path):
    for step in (1, 2, 3):
        checkpoints.save(step, sharded={"x": np.arange(6.0).reshape(3, 2) * step}, meta={"step": step})
    with pytest.raises(ValueError, match="step 3 is not after the last saved or loaded step 3"):
        checkpoints.save(3)
    restored = checkpoints.load()
    assert restored.step == 3 and restored.meta == {"step": 3}
    assert np.array_equal(restored.sharded["x"], np.arange(6.0).reshape(3, 2) * 3)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "latest",
        "lock",  # held while the checkpointer is open
        "step-00000002.h5",
        "step-00000002.json",
        "step-00000003.h5",
        "step-00000003.json",
    ]
    manifest = json.loads((tmp_path / "ckpt" / "step-00000003.json").read_text())
    assert manifest["arrays"]["x"]["blocks"][0][:2] == [0, 3] and manifest["levels"] == ["shared"]
    assert checkpoints.load(2).step == 2


def test_a_manifest_newer_than_latest_is_ignored(checkpoints, tmp_path):
    """A crash between the manifest's rename and the `latest` update leaves the older step current."""
    checkpoints.save(1, sharded={"x": np.zeros(2)})
    checkpoints.save(2, sharded={"x": np.ones(2)})
    checkpoints.wait()
    (tmp_path / "ckpt" / "latest").write_text("1\n")
    assert checkpoints.load().step == 1


def test_steps_lists_committed_checkpoints_newest_first(checkpoints):
    for step in (3, 7):
        checkpoints.save(step, replicated={"w": np.full(4, step, dtype=np.float64)})
    assert checkpoints.steps() == [7, 3]  # waits for the background write of step 7


def test_checkpoints_with_zlib_crc32_from_before_crc32c_still_load(tmp_path):
    """Manifests without a "checksum" name were written with zlib's CRC-32: they load, and corruption is caught."""
    import zlib

    x = np.arange(12.0).reshape(6, 2)
    with Checkpointer(tmp_path / "ckpt", MPI.COMM_SELF, keep=2, background=False) as checkpoints:
        checkpoints.save(1, sharded={"x": x}, replicated={"lr": np.array(0.5)})
    manifest_path = tmp_path / "ckpt" / "step-00000001.json"
    manifest = json.loads(manifest_path.read_text())
    assert {entry["checksum"] for entry in manifest["arrays"].values()} == {"crc32c"}
    old = {"x": x, "lr": np.array(0.5)}
    for name, entry in manifest["arrays"].items():  # as the previous version wrote them
        del entry["checksum"]
        entry["blocks"][0][2] = zlib.crc32(np.ascontiguousarray(old[name]).tobytes())
    manifest_path.write_text(json.dumps(manifest))
    with Checkpointer(tmp_path / "ckpt", MPI.COMM_SELF) as checkpoints:
        restored = checkpoints.load()
        assert np.array_equal(restored.sharded["x"], x) and restored.replicated["lr"] == 0.5
    manifest["arrays"]["x"]["blocks"][0][2] ^= 1  # a checksum that no longer matches
    manifest_path.write_text(json.dumps(manifest))
    with Checkpointer(tmp_path / "ckpt", MPI.COMM_SELF) as checkpoints, pytest.raises(CheckpointError):
        checkpoints.load()


@pytest.mark.parametrize("key", ["settings", "config", "job"], ids=["now", "older-dictlearn", "older-train"])
def test_a_jobs_checkpoint_is_resumed_under_todays_and_older_settings_keys(checkpoints, tmp_path, key):
    """Checkpoints keep the settings they belong to under one key; those of older versions stay resumable."""
    from mpiscale.jobs import restore_compatible

    expected = {"atoms": 50, "seed": 0}
    checkpoints.save(3, replicated={"x": np.ones(2)}, meta={key: expected})
    checkpoints.wait()
    restored = restore_compatible(checkpoints, True, "ckpt", expected, "iteration")
    assert restored is not None and restored.step == 3
    with pytest.raises(CheckpointError, match="belongs to another job \\(atoms: checkpoint 50, now 60\\)"):
        restore_compatible(checkpoints, True, "ckpt", expected | {"atoms": 60}, "iteration")
    with pytest.raises(CheckpointError, match="already holds checkpoints \\(newest: iteration 3\\)"):
        restore_compatible(checkpoints, False, "ckpt", expected, "iteration")


def test_a_checkpoint_from_before_a_setting_existed_resumes_with_its_old_value_only(checkpoints):
    """dictlearn's max_residual and remove_mean came after its first checkpoints: one that does not name them was
    saved without an error target or mean removal, and resumes only under those."""
    from mpiscale.jobs import restore_compatible

    checkpoints.save(3, replicated={"x": np.ones(2)}, meta={"settings": {"atoms": 50}})
    checkpoints.wait()
    added = {"max_residual": 0.0, "remove_mean": False}
    restored = restore_compatible(checkpoints, True, "ckpt", {"atoms": 50} | added, "iteration", added=added)
    assert restored is not None and restored.step == 3
    with pytest.raises(CheckpointError, match="remove_mean: checkpoint False, now True"):
        restore_compatible(checkpoints, True, "ckpt", {"atoms": 50, "remove_mean": True}, "iteration", added=added)
