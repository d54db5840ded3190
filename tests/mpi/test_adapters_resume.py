"""`mpiscale compress-adapters` over more than one run: a stopped run resumed on another number of ranks, and new
adapters joining an earlier compressed file (whose adapters' weights the joining run never reads)."""

import shutil

import h5py
import numpy as np
import pytest
from adapter_files import read_adapter
from helpers import Job, assert_ok, finish, held_at_step, interrupt, launch, run_alone
from test_adapters import RANK, SHARED, compressed
from test_train import MPISCALE, mpiscale

from mpiscale.adapters.planted import write_planted

GROUPS = tuple(f"base_model.model.model.layers.{i}.self_attn.{p}_proj" for i in range(6) for p in "qv")


def rebuilt(got: dict, index: int, row: int) -> np.ndarray:
    """Adapter ``row``'s update of group ``index`` as the file rebuilds it (signs of components cancel)."""
    group = got[index]
    a = group["A/loadings"][row].astype(np.float64) @ group["A/components"]
    b = (group["B/loadings"][row].astype(np.float64) @ group["B/components"]).T
    return b @ a


@pytest.fixture(scope="module")
def planted_groups(tmp_path_factory):
    """9 planted adapters of 12 layer groups, the options, and one uninterrupted run's file on 1 rank."""
    root = tmp_path_factory.mktemp("groups")
    write_planted(root / "adapters", 9, RANK, shared=SHARED, modules=GROUPS)
    # Power iterations (each a pass over the adapters) make each group take a while: 0.02 s on 2 ranks of an idle
    # 2-core VM. (The interrupted runs are held at their group, so a stop lands mid-run however short the groups.)
    options = ["--adapters", root / "adapters", "--method", "randomized", "--components", SHARED,
               "--power-iterations", 50]  # fmt: skip
    assert_ok(mpiscale(1, "compress-adapters", *options, "--out", root / "whole.h5"))
    return options, compressed(root / "whole.h5")


def interrupted(options: list, out, log, way: str) -> tuple[Job, int]:
    """A run on 2 ranks, ``interrupt``ed ``way`` once it said its first group's end; (the job, the last group it
    had said done then)."""
    with open(log, "w") as stdout:
        process = launch(2, [*MPISCALE, "compress-adapters", *map(str, options), "--out", str(out),
                             "--progress-every", "0.001"], stdout=stdout)  # fmt: skip
        with held_at_step(process, log, str(out), "group", 1) as (ranks, seen):
            interrupt(ranks, way)
        return finish(process, "compress-adapters interrupted", 60), seen


def assert_as_uninterrupted(out, whole: dict) -> None:
    got = compressed(out)
    np.testing.assert_allclose(got["error"], whole["error"], rtol=1e-4, atol=1e-8)
    for index in range(len(GROUPS)):
        for side in "AB":
            np.testing.assert_allclose(got[index][f"{side}/explained"], whole[index][f"{side}/explained"], rtol=1e-6)
        for row in (0, 4, 8):
            np.testing.assert_allclose(rebuilt(got, index, row), rebuilt(whole, index, row), atol=1e-5)


def assert_said_unfinished(kept, out, done: int) -> None:
    """``inspect`` of an unfinished run's file says how many groups it holds and how to finish (it failed on the
    first group not done)."""
    shown = run_alone("inspect", kept)
    assert_ok(shown)
    assert f"layer groups: {done} of {len(GROUPS)} done; mpiscale compress-adapters --resume --out {out}," in (
        shown.stdout), shown.stdout  # fmt: skip
    assert "components per group and side: " in shown.stdout and "relative error" not in shown.stdout


def test_a_stopped_run_resumes_on_another_number_of_ranks(planted_groups, tmp_path):
    """SIGTERM after a few of 12 groups: the groups done stay in OUT.partial (no OUT); a run without --resume or with
    other settings is refused and leaves it as it was; --resume on 3 ranks does the rest and equals one
    uninterrupted run on 1 rank."""
    options, whole = planted_groups
    out, partial, log = tmp_path / "c.h5", tmp_path / "c.h5.partial", tmp_path / "stopped.log"
    stopped, seen = interrupted(options, out, log, "stopped")
    assert stopped.returncode == 143, stopped.output[-3000:]
    assert "SIGTERM received, stopping after the current step" in stopped.stderr, stopped.stderr[-3000:]
    assert partial.exists() and not out.exists() and not (tmp_path / "c.h5.tmp").exists()
    with h5py.File(partial, "r") as file:
        done = int(file.attrs["groups_done"])
    # obeyed within two groups' ends of the one it came in, as steering promises for steps of any length (steps of
    # 0.25 s or more: at the end of that group, which stops.py long-steps checks with steps of a fixed length)
    assert seen <= done <= seen + 2 < len(GROUPS), (seen, done)
    assert f"kept the {done} of {len(GROUPS)} layer groups done in {partial}" in log.read_text()
    assert_said_unfinished(partial, out, done)
    before = partial.read_bytes()

    again = mpiscale(1, "compress-adapters", *options, "--out", out)
    assert again.returncode == 2 and "pass --resume" in again.stderr
    other = mpiscale(1, "compress-adapters", *options, "--out", out, "--seed", 7, "--resume")
    assert other.returncode == 2 and "seed: stopped run 0, now 7" in other.stderr
    assert partial.read_bytes() == before  # refused runs leave the stopped run's work as it was

    resumed = mpiscale(3, "compress-adapters", *options, "--out", out, "--resume")
    assert_ok(resumed)
    assert f"resumed from {partial}: {done} of {len(GROUPS)} layer groups were done" in resumed.stdout
    assert out.exists() and not partial.exists()
    assert_as_uninterrupted(out, whole)


def test_a_killed_run_resumes_from_the_groups_it_marked(planted_groups, tmp_path):
    """A rank SIGKILLed after a few groups: OUT.tmp keeps the groups marked done (a plain run wrote its first group
    over them, and --resume started again from the first); a plain run now is refused and leaves it as it was, and
    --resume on 1 rank drops what the killed run began of its next group and equals one uninterrupted run."""
    options, whole = planted_groups
    out, kept = tmp_path / "c.h5", tmp_path / "c.h5.tmp"
    killed, seen = interrupted(options, out, tmp_path / "killed.log", "killed")
    assert killed.returncode != 0 and kept.exists() and not out.exists(), killed.output[-3000:]
    with h5py.File(kept, "r+") as file:
        done = int(file.attrs["groups_done"])
        file.create_dataset(f"groups/{done:04d}/error", data=np.zeros(3))  # as a kill between its add and mark left it
    assert seen <= done < len(GROUPS), (seen, done)
    assert_said_unfinished(kept, out, done)
    before = kept.read_bytes()
    again = mpiscale(2, "compress-adapters", *options, "--out", out)
    said = again.stderr.splitlines()
    assert again.returncode == 2 and "pass --resume" in said[-1], again.stderr
    assert len(said) == 1 or (len(said) == 2 and "taking over the lock" in said[0]), again.stderr  # (the killed run's)
    assert kept.read_bytes() == before
    resumed = mpiscale(1, "compress-adapters", *options, "--out", out, "--resume")
    assert_ok(resumed)
    assert f"resumed from {kept}: {done} of {len(GROUPS)} layer groups were done" in resumed.stdout
    assert out.exists() and not kept.exists()
    assert_as_uninterrupted(out, whole)


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """15 planted adapters, the first 10 in ``earlier/`` and the last 5 in ``later/``; and their weights."""
    root = tmp_path_factory.mktemp("join")
    bases = write_planted(root / "all", 15, RANK, shared=SHARED)
    for i in range(15):
        shutil.copytree(root / "all" / f"task-{i}", root / ("earlier" if i < 10 else "later") / f"task-{i}")
    return root, bases, [read_adapter(root / "all" / f"task-{i}") for i in range(15)]


def true_errors(got: dict, weights: list[dict]) -> np.ndarray:
    """Each adapter's relative error against its original weights, from the file's rebuilt updates."""
    errors, norms = np.zeros(len(weights)), np.zeros(len(weights))
    for index, module in enumerate(got["modules"]):
        for row, tensors in enumerate(weights):
            update = tensors[f"{module}.lora_B.weight"].astype(np.float64) @ tensors[f"{module}.lora_A.weight"]
            errors[row] += np.linalg.norm(update - rebuilt(got, index, row)) ** 2
            norms[row] += np.linalg.norm(update) ** 2
    return np.sqrt(errors / norms)


def test_new_adapters_join_an_earlier_file_as_if_compressed_together(planted, tmp_path):
    """An earlier file that kept every component, joined by 5 new adapters on 2 ranks: the same components, shares
    and rebuilt adapters as compressing all 15 in one run; the earlier adapters' errors are marked as bounds."""
    root, _, weights = planted
    earlier, joined, together = tmp_path / "earlier.h5", tmp_path / "joined.h5", tmp_path / "together.h5"
    assert_ok(mpiscale(1, "compress-adapters", "--adapters", root / "earlier", "--variance", 1.0, "--out", earlier))
    job = mpiscale(2, "compress-adapters", "--adapters", root / "later", "--add-to", earlier,
                   "--components", SHARED, "--out", joined)  # fmt: skip
    assert_ok(job)
    assert f"wrote {joined}: 15 adapters (10 of them from {earlier})" in job.stdout
    assert_ok(mpiscale(2, "compress-adapters", "--adapters", root / "all", "--components", SHARED, "--out", together))
    got, whole = compressed(joined), compressed(together)
    assert got["names"] == whole["names"] == [f"task-{i}" for i in range(15)]
    for index in range(len(got["modules"])):
        for side in "AB":
            np.testing.assert_allclose(got[index][f"{side}/explained"], whole[index][f"{side}/explained"], rtol=1e-5)
        for row in range(15):
            np.testing.assert_allclose(rebuilt(got, index, row), rebuilt(whole, index, row), atol=1e-5)
    truth = true_errors(got, weights)
    np.testing.assert_allclose(got["error"][10:], truth[10:], rtol=1e-3)  # the new adapters': exact
    assert (got["error"][:10] >= truth[:10] * (1 - 1e-3)).all()  # the earlier ones': bounds, here tight
    np.testing.assert_allclose(got["error"][:10], truth[:10], rtol=0.05, atol=1e-7)
    with h5py.File(joined, "r") as file:
        assert list(file["adapters/error_bound"][()]) == [1] * 10 + [0] * 5
    report = mpiscale(1, "inspect", joined)
    assert_ok(report)
    assert "10 of them are upper bounds" in report.stdout


def test_joining_a_truncated_file_bounds_the_earlier_errors_and_refuses_clashes(planted, tmp_path):
    """An earlier file of 6 components per side: joined, the earlier adapters' stored errors bound their true
    errors, the new ones' are exact, and the planted subspace is found. An output equal to the earlier file, an
    adapter named as an earlier one and an earlier adapter under a new name are refused, naming the adapter."""
    root, bases, weights = planted
    earlier, joined = tmp_path / "earlier.h5", tmp_path / "joined.h5"
    assert_ok(mpiscale(2, "compress-adapters", "--adapters", root / "earlier", "--components", SHARED,
                       "--out", earlier))  # fmt: skip
    assert_ok(mpiscale(2, "compress-adapters", "--adapters", root / "later", "--add-to", earlier,
                       "--components", SHARED, "--out", joined))  # fmt: skip
    got = compressed(joined)
    truth = true_errors(got, weights)
    np.testing.assert_allclose(got["error"][10:], truth[10:], rtol=1e-3)
    assert (got["error"][:10] >= truth[:10] * (1 - 1e-3)).all()
    for index, module in enumerate(got["modules"]):
        for side, basis in zip("AB", bases[module], strict=True):
            cosines = np.linalg.svd(basis @ got[index][f"{side}/components"].T.astype(np.float64), compute_uv=False)
            assert cosines.min() > 0.9999

    before = earlier.read_bytes()
    onto = mpiscale(1, "compress-adapters", "--adapters", root / "later", "--add-to", earlier, "--out", earlier)
    assert onto.returncode == 2 and "is an input of this job" in onto.stderr, onto.stderr[-2000:]
    clash = tmp_path / "clash"
    shutil.copytree(root / "earlier" / "task-3", clash / "task-3")
    named = mpiscale(1, "compress-adapters", "--adapters", clash, "--add-to", earlier, "--out", tmp_path / "x.h5")
    assert named.returncode == 2 and "task-3: has the name of an adapter in" in named.stderr, named.stderr[-2000:]
    shutil.move(clash / "task-3", clash / "renamed")
    same = mpiscale(1, "compress-adapters", "--adapters", clash, "--add-to", earlier, "--out", tmp_path / "x.h5")
    assert same.returncode == 2 and f"its weights are in {earlier} already (as task-3)" in same.stderr
    assert earlier.read_bytes() == before and not (tmp_path / "x.h5").exists()
