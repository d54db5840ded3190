"""The examples (examples/, and the README's program) run as written."""

import re
import sys

import h5py
from helpers import REPO, assert_ok, finish, launch


def test_hello_actors(ranks, tmp_path):
    """Run from the user's own directory, where ``mpiscale.run`` leaves the job's telemetry records."""
    process = launch(ranks, [sys.executable, str(REPO / "examples" / "hello_actors.py")], cwd=tmp_path)
    job = finish(process, "examples/hello_actors.py", timeout=90)
    assert_ok(job)
    assert f"{ranks} ranks, total {2 * 100 * 45 * ranks}" in job.stdout
    last = (tmp_path / "hello_actors.telemetry.jsonl").read_text().splitlines()[-1]
    assert '"state": "finished", "command": "hello_actors"' in last, last


def test_the_readmes_program_runs_as_written(tmp_path):
    """The README's first program, copied from it, on 3 ranks: it prints what the README says it prints for 4."""
    readme = (REPO / "README.md").read_text()
    program = readme.split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "ring.py").write_text(program)
    assert "4 ranks: the\nranks sum to 6" in readme or "4 ranks: the ranks sum to 6" in readme
    job = finish(launch(3, [sys.executable, str(tmp_path / "ring.py")], cwd=tmp_path), "the README's program", 90)
    assert_ok(job)
    assert "3 ranks: the ranks sum to 3" in job.stdout


def test_dictionary_learning_from_python_prints_the_same_error_on_one_and_on_several_ranks(tmp_path):
    script = [sys.executable, str(REPO / "examples" / "dictlearn_from_python.py")]
    said = {}
    for ranks in (1, 3):
        job = finish(launch(ranks, script, cwd=tmp_path), f"examples/dictlearn_from_python.py on {ranks}", 90)
        assert_ok(job)
        assert f"from 1,500 digits on {ranks} rank" in job.stdout, job.stdout
        said[ranks] = job.stdout.splitlines()[-1]
    assert said[1] == said[3] and "297 unseen digits, 5 atoms each: relative error 0.3" in said[1], said


def test_image_denoising_with_mpiscales_own_commands_gains_over_4_db(tmp_path):
    """The guide's denoising, as it is written, on a 64x64 cut of the photo: prepare, dictlearn, encode, rebuild."""
    script = [sys.executable, str(REPO / "examples" / "denoise_image.py")]
    folder = tmp_path / "denoise"
    steps = [
        [*script, "prepare", str(folder), "--sigma", "20", "--size", "64"],
        [sys.executable, "-m", "mpiscale.cli", "dictlearn", "--data", f"{folder}/noisy.h5:/patches", "--remove-mean",
         "--atoms", "64", "--sparsity", "16", "--max-residual", "184", "--iterations", "100", "--batch-size", "128",
         "--out", str(folder / "dictionary.h5")],
        [sys.executable, "-m", "mpiscale.cli", "encode", "--dictionary", str(folder / "dictionary.h5"), "--data",
         f"{folder}/noisy.h5:/patches", "--sparsity", "32", "--max-residual", "184", "--out", str(folder / "codes.h5")],
        [*script, "rebuild", str(folder)],
    ]  # fmt: skip
    said = []
    for command in steps:
        ranks = 1 if command[1] == script[1] else 2  # the example's own steps are one process
        job = finish(launch(ranks, command, cwd=tmp_path), " ".join(command[1:4]), 120)
        assert_ok(job)
        said.append(job.stdout)
    assert "code to --max-residual 184" in said[0], said[0]
    found = re.search(r"noisy ([0-9.]+) dB -> denoised ([0-9.]+) dB", said[-1])
    assert found and float(found[2]) - float(found[1]) > 4, said[-1]


def _train(ranks: int, workdir, epochs: int) -> str:
    script = REPO / "examples" / "train_with_checkpoints.py"
    command = [sys.executable, str(script), str(workdir), "--epochs", str(epochs)]
    process = launch(ranks, command, cwd=workdir.parent)
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


def test_image_patch_dictionary(tmp_path):
    """The image-patch example writes its data set; dictlearn learns from it with the example TOML; inspect plots."""
    patches = tmp_path / "patches.h5"
    script = REPO / "examples" / "image_patches.py"
    command = [sys.executable, str(script), str(patches), "--per-image", "2000"]
    job = finish(launch(2, command, cwd=tmp_path), "image_patches", 90)
    assert_ok(job)
    assert "/patches (4000, 64)" in job.stdout
    out = tmp_path / "atoms.h5"
    config = REPO / "examples" / "dictlearn-patches.toml"
    learn = [
        sys.executable,
        "-m",
        "mpiscale.cli",
        "dictlearn",
        "--config",
        str(config),
        "--data",
        f"{patches}:/patches",
    ]
    learn += ["--out", str(out), "--iterations", "40", "--checkpoint-dir", str(tmp_path / "ckpt")]
    job = finish(launch(2, learn), "dictlearn on image patches", 120)
    assert_ok(job)
    assert "wrote" in job.stdout and (tmp_path / "ckpt").is_dir()
    with h5py.File(out, "r") as file:
        error = file["metrics"]["error"][()]
        assert error[-10:].mean() < 0.9 * error[:3].mean(), error  # the patches are learned, not just read
        assert list(file.attrs["patch_shape"]) == [8, 8]
    image = tmp_path / "atoms.png"
    job = finish(
        launch(1, [sys.executable, "-m", "mpiscale.cli", "inspect", str(out), "--plot", str(image)]), "inspect", 60
    )
    assert_ok(job)
    assert "256 atoms of 64 features" in job.stdout and image.stat().st_size > 10_000


def test_pipeline_example_learns(tmp_path):
    """Three stages, 1F1B: the mean loss of the last 20 steps is well below that of the first 20."""
    process = launch(3, [sys.executable, str(REPO / "examples" / "pipeline_mlp.py")], cwd=tmp_path)
    job = finish(process, "examples/pipeline_mlp.py on 3 ranks", timeout=90)
    assert_ok(job)
    lines = [line for line in job.stdout.splitlines() if "mean loss" in line]
    means = [float(line.split("mean loss ")[1].split(",")[0]) for line in lines]
    assert len(means) == 3 and means[-1] < 0.7 * means[0], job.stdout
