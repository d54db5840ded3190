"""The examples in docs/ run as written."""

import sys

from conftest import REPO, assert_ok, finish, launch


def test_hello_actors(ranks):
    process = launch(ranks, [sys.executable, str(REPO / "examples" / "hello_actors.py")])
    job = finish(process, "examples/hello_actors.py", timeout=90)
    assert_ok(job)
    assert f"{ranks} ranks, total {2 * 100 * 45 * ranks}" in job.stdout


def _train(ranks: int, workdir, epochs: int) -> str:
    script = REPO / "examples" / "train_with_checkpoints.py"
    process = launch(ranks, [sys.executable, str(script), str(workdir), "--epochs", str(epochs)])
    job = finish(process, f"examples/train_with_checkpoints.py --epochs {epochs} on {ranks} ranks", timeout=90)
    assert_ok(job)
    return job.stdout


def test_training_resumes_on_another_world_size(tmp_path):
    """Stopped after 2 epochs on 2 ranks and resumed on 4, training ends where an uninterrupted 3-rank run does."""
    _train(2, tmp_path / "interrupted", 2)
    resumed = _train(4, tmp_path / "interrupted", 4)
    assert "resumed at epoch 2 on 4 ranks" in resumed
    straight = _train(3, tmp_path / "straight", 4)
    assert "resumed" not in straight
    final = [line for line in (resumed, straight) for line in line.splitlines() if line.startswith("weights")]
    assert final[0] == final[1], final
