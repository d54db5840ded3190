"""The circuit catalogue from a real pipeline (train -> collect -> dictlearn) and users' own modules: add, search,
similar over the ranks, and `circuits run --all-features` checked against the models run in this process."""

import json
import shutil
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from helpers import (
    assert_ok,
    finish,
    flip_a_bit,
    gpu_ranks,
    held_at_step,
    interrupt,
    launch,
    on_a_gpu,
    real_torch_gpu,
    run_alone,
    run_cli,
)

from mpiscale.circuits.store import ModelRef, NewCircuits, add_circuits, file_sha256
from mpiscale.dictlearn import top_inputs
from mpiscale.train.results import load_trained

DIGITS = 64  # the bundled digits: 8 x 8 pixels


# Heavy's 60 chained float32 products round differently with another batch size or thread count (a run's batches
# of 20 against the whole input at once here): its features, of magnitude 0.01-0.4, agree to about 1e-5.
TANH_CHAIN_ATOL = 1e-4


class Heavy(torch.nn.Module):
    """A user's module that takes a while per batch (many products), so a run can be stopped or killed mid-way."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.inner = torch.nn.Parameter(torch.randn(DIGITS, 256, generator=generator) / 8)
        self.mix = torch.nn.Parameter(torch.randn(256, 256, generator=generator) / 16)
        self.out = torch.nn.Parameter(torch.randn(256, 6, generator=generator) / 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ self.inner)
        for _ in range(60):
            h = torch.tanh(h @ self.mix)
        return h @ self.out


class Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.layer = torch.nn.Linear(DIGITS, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.layer(x))


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory) -> Path:
    """A digit classifier (one process), its two hidden layers' activations, a dictionary of each; a user's
    TorchScript module and an exported one."""
    root = tmp_path_factory.mktemp("pipeline")
    assert_ok(run_alone("train", "--epochs", 1, "--hidden", "24,12", "--out", root / "model.h5",
                        "--progress-every", 0))  # fmt: skip
    assert_ok(run_alone("collect", "--model", root / "model.h5", "--layers", "relu1,relu2", "--out", root / "acts.h5"))
    for layer, atoms in (("relu1", 10), ("relu2", 6)):
        assert_ok(run_alone("dictlearn", "--data", f"{root / 'acts.h5'}:/{layer}", "--atoms", atoms, "--sparsity", 2,
                            "--iterations", 30, "--out", root / f"{layer}.h5", "--progress-every", 0))  # fmt: skip
    torch.jit.save(torch.jit.script(Small().eval()), root / "small.pt")
    batch = {"x": {0: torch.export.Dim("batch", min=1)}}  # circuits run in batches of any size
    program = torch.export.export(Heavy().eval(), (torch.zeros(2, DIGITS),), dynamic_shapes=batch)
    torch.export.save(program, root / "heavy.pt2")
    return root


def build_catalogue(root: Path, path: Path) -> None:
    """relu1's and relu2's atoms (tags, fields), the TorchScript module projected on atoms a user wrote with h5py,
    and the exported heavy module's outputs."""
    assert_ok(run_alone("circuits", "add", path, "--dictlearn", root / "relu1.h5", "--tag", "digits", "--field",
                        "epoch=1", "--field", "note=first"))  # fmt: skip
    assert_ok(run_alone("circuits", "add", path, "--dictlearn", root / "relu2.h5", "--tag", "digits", "--tag", "deep"))
    with h5py.File(root / "projections.h5", "w") as file:
        file["P"] = np.random.default_rng(2).standard_normal((3, 5))
    fields = [{"score": 0.5, "who": "a"}, {"score": 2.0, "who": "b"}, {"score": 7.0, "who": "c"}]
    (root / "fields.json").write_text("\ufeff" + json.dumps(fields), encoding="utf-8")  # a byte order mark, as Notepad
    projections = f"{root / 'projections.h5'}:/P"
    small = run_alone("circuits", "add", path, "--module", root / "small.pt", "--name", "small", "--inputs", DIGITS,
                      "--projections", projections, "--fields", root / "fields.json")  # fmt: skip
    assert_ok(small)
    assert small.stderr == "", small.stderr  # the TorchScript archive is told apart: torch.export never tries it
    assert_ok(run_alone("circuits", "add", path, "--module", root / "heavy.pt2", "--name", "heavy", "--inputs",
                        DIGITS, "--tag", "slow"))  # fmt: skip


@pytest.fixture(scope="module")
def built(pipeline) -> Path:
    path = pipeline / "catalogue.h5"
    build_catalogue(pipeline, path)
    return path


def test_the_catalogue_holds_every_circuit_readable_with_plain_h5py(pipeline, built):
    """Atoms are the dictionaries' rows; usage and top inputs are the dictionary's own coder's; the model is an
    external link to the train results' weights (never a copy); fields and tags are columns; a name taken, a NaN
    embedding and a file that is not a catalogue are refused with the catalogue left byte for byte."""
    model = pipeline / "model.h5"
    with h5py.File(built, "r") as file, h5py.File(model, "r") as weights:
        assert file.attrs["format"] == "mpiscale.circuits/1" and file.attrs["circuits"] == 10 + 6 + 3 + 6
        names = file["circuits/name"].asstr()[()]
        assert list(names[:2]) == ["model.relu1/atom0000", "model.relu1/atom0001"] and names[-1] == "heavy/5"
        group = file["models/0000"]
        assert group.attrs["kind"] == "train" and group.attrs["sha256"] == file_sha256(str(model))
        np.testing.assert_array_equal(group["weights/hidden1.weight"][()], weights["model/hidden1.weight"][()])
        assert isinstance(group.get("weights", getlink=True), h5py.ExternalLink)
        assert [file[f"models/{m}"].attrs["kind"] for m in ("0001", "0002")] == ["torchscript", "export"]
        for index, layer in enumerate(("relu1", "relu2")):
            prefix = file[f"prefixes/{index:04d}"]
            assert prefix.attrs["layer"] == layer
            with h5py.File(pipeline / f"{layer}.h5", "r") as learned:
                np.testing.assert_array_equal(prefix["atoms"][()], learned["dictionary"][()].astype(np.float32))
        entries, _ = top_inputs(str(pipeline / "relu1.h5"), 5)
        for entry in entries:
            assert file["circuits/usage"][entry.atom] == entry.used_by
            np.testing.assert_array_equal(file["circuits/top_inputs"][entry.atom, : len(entry.ids)], entry.ids)
            labels = file["circuits/top_labels"].asstr()[entry.atom, : len(entry.ids)]
            assert list(labels) == [str(label) for label in entry.labels]
        assert list(file["circuits/fields/score"][16:19]) == [0.5, 2.0, 7.0]
        assert np.isnan(file["circuits/fields/score"][0]) and file["circuits/fields/epoch"][0] == 1.0
        assert file["circuits/fields/note"].asstr()[0] == "first" and file["circuits/fields/note"].asstr()[16] == ""
        assert file["circuits/tags"].asstr()[12] == "digits,deep"
        np.testing.assert_allclose(np.linalg.norm(file["spaces/0000/vectors"][()], axis=1), 1, rtol=1e-6)

    before = built.read_bytes()
    taken = run_alone("circuits", "add", built, "--dictlearn", pipeline / "relu1.h5", "--top", 0)
    assert taken.returncode == 2 and "holds a circuit named 'model.relu1/atom0000' already" in taken.stderr
    np.save(pipeline / "nan.npy", np.full((3, 4), np.nan))
    projections = f"{pipeline / 'projections.h5'}:/P"
    nan = run_alone("circuits", "add", built, "--module", pipeline / "small.pt", "--name", "other", "--inputs", DIGITS,
                    "--projections", projections, "--embeddings", pipeline / "nan.npy")  # fmt: skip
    assert nan.returncode == 2 and "embeddings row 0 holds NaN" in nan.stderr
    wrong = run_alone("circuits", "add", pipeline / "model.h5", "--dictlearn", pipeline / "relu2.h5", "--top", 0)
    assert wrong.returncode == 2 and "not an mpiscale file of format mpiscale.circuits/1" in wrong.stderr
    width = run_alone("circuits", "add", built, "--dictlearn", pipeline / "relu2.h5", "--layer", "relu1", "--top", 0)
    assert width.returncode == 2 and "layer 'relu1'" in width.stderr and "outputs 24" in width.stderr
    narrow = run_alone("circuits", "add", built, "--module", pipeline / "small.pt", "--name", "n", "--inputs", 5)
    assert narrow.returncode == 2 and narrow.stderr.count("\n") == 1, narrow.stderr  # one line, no TorchScript trace
    assert "did not take a batch of one row of 5 float32 numbers" in narrow.stderr and "(1x5 and 64x5)" in narrow.stderr
    assert built.read_bytes() == before and not Path(f"{built}.tmp").exists()


def test_inspect_summarizes_the_activations_collect_wrote(pipeline):
    """Where the rows came from, each layer's shape, share of zeros and mean (as numpy finds them in the file), and
    the command that learns from a layer."""
    acts = pipeline / "acts.h5"
    shown = run_alone("inspect", acts)
    assert_ok(shown)
    with h5py.File(acts, "r") as file:
        layers = {name: file[name][()] for name in ("relu1", "relu2")}
        inputs = file.attrs["inputs"]
    assert f"{acts}: activations of 1,437 inputs from the model {pipeline / 'model.h5'} on 1 rank (cpu)" in shown.stdout
    assert f"inputs: {inputs}; labels: " in shown.stdout
    for name, values in layers.items():
        assert (f"/{name}: 1,437 x {values.shape[1]} float32; over all rows: {np.mean(values == 0):.1%} zeros, mean "
                f"{values.mean():.4g}\n") in shown.stdout, shown.stdout  # fmt: skip
    assert f"learn a dictionary of a layer: mpiscale dictlearn --data {acts}:/relu1" in shown.stdout


def test_files_that_name_each_other_by_relative_paths_are_found_from_any_folder(pipeline, tmp_path):
    """dictlearn run from a parent folder records its data as typed there (run/acts.h5): circuits add run from the
    results' own folder, and inspect --top-inputs from a third, find the data all the same (recorded absolute and
    relative to the results file; a file of an earlier version, with the typed path alone, by its name beside)."""
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(pipeline / "acts.h5", run / "acts.h5")
    assert_ok(run_alone("dictlearn", "--data", "run/acts.h5:/relu1", "--atoms", 10, "--sparsity", 2, "--iterations",
                        10, "--out", "run/f1.h5", "--progress-every", 0, cwd=tmp_path))  # fmt: skip
    with h5py.File(run / "f1.h5", "r") as file:
        assert file.attrs["data"] == f"{run / 'acts.h5'}:/relu1" and file.attrs["data_relative"] == "acts.h5:/relu1"
    added = run_alone("circuits", "add", "c.h5", "--dictlearn", "f1.h5", cwd=run)
    assert_ok(added)
    moved = tmp_path / "moved"
    run.rename(moved)  # the tree copied elsewhere: the absolute path is gone, the relative one is found
    with h5py.File(moved / "f1.h5", "r+") as file:
        del file.attrs["data_relative"]  # as an earlier version wrote it: the typed path alone
        file.attrs["data"] = "run/acts.h5:/relu1"
    shown = run_alone("inspect", moved / "f1.h5", "--top-inputs", 2, cwd=pipeline)
    assert_ok(shown)
    assert "atoms by use" in shown.stdout
    (moved / "acts.h5").unlink()  # the data gone altogether: refused in one line, no traceback
    refused = run_alone("inspect", moved / "f1.h5", "--top-inputs", 2, cwd=pipeline)
    assert refused.returncode == 2 and "Traceback" not in refused.output, refused.output
    assert refused.stderr.startswith("mpiscale inspect: ") and len(refused.stderr.strip().splitlines()) == 1


def test_search_filters_metadata(built):
    """Filters on derived columns, numbers, user fields, tags and patterns; refused filters name the columns."""
    with h5py.File(built, "r") as file:
        usage = file["circuits/usage"][()]
    busy = int(((usage >= 200) & (np.arange(len(usage)) >= 10) & (np.arange(len(usage)) < 16)).sum())
    found = run_alone("circuits", "search", built, "--where", "layer=relu2;usage>=200", "--limit", 0)
    assert_ok(found)
    assert f"{busy} of 25 circuits match" in found.stdout
    assert_ok(scored := run_alone("circuits", "search", built, "--where", "score>1", "--where", "who!=c",
                                  "--json", built.parent / "s.json"))  # fmt: skip
    assert "1 of 25 circuits match" in scored.stdout and "small/1" in scored.stdout
    assert [r["name"] for r in json.loads((built.parent / "s.json").read_text())] == ["small/1"]
    assert "6 of 25" in run_alone("circuits", "search", built, "--where", "tag=slow").stdout
    assert "16 of 25" in run_alone("circuits", "search", built, "--where", "name=model.relu?/atom*").stdout
    unknown = run_alone("circuits", "search", built, "--where", "colour=red")
    assert unknown.returncode == 2 and "no column 'colour'" in unknown.stderr and "usage" in unknown.stderr
    text = run_alone("circuits", "search", built, "--where", "layer>3")
    assert text.returncode == 2 and "layer is text" in text.stderr
    unset = run_alone("circuits", "search", built, "--where", "")  # ``--where "$LAYERS"``, the variable unset
    assert unset.returncode == 2 and "--where '' holds no filter (an unset shell variable?)" in unset.stderr


def test_similar_is_exact_and_the_same_on_any_number_of_ranks(pipeline, tmp_path):
    """4,000 user embeddings of 24 numbers in one space (a 2,000-row slice per add): batched vector queries with a
    filter on 1 process and on 3 ranks equal numpy's brute force; --to leaves the circuit itself out."""
    path = tmp_path / "big.h5"
    rng = np.random.default_rng(5)
    vectors = rng.standard_normal((4000, 24))
    model = ModelRef.of(str(pipeline / "small.pt"), "torchscript", DIGITS, "float32")
    for part in range(2):  # in this process: the command line's add is tested above, and loads torch each time
        batch = NewCircuits(model, "", [f"part{part}/{j}" for j in range(2000)], rng.standard_normal((2000, 5)),
                            "test", embeddings=vectors[part * 2000 : (part + 1) * 2000], space="mine",
                            fields={"part": [part] * 2000})  # fmt: skip
        add_circuits(str(path), batch)
    queries = rng.standard_normal((7, 24))
    np.save(tmp_path / "q.npy", queries)
    args = ["circuits", "similar", path, "--vector", tmp_path / "q.npy", "-k", 10, "--where", "atom<0;part!=1"]
    one = run_alone(*args, "--json", tmp_path / "one.json")
    assert_ok(one)
    many = run_cli(3, *args, "--json", tmp_path / "many.json", timeout=90)
    assert_ok(many)
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    scores = (queries / np.linalg.norm(queries, axis=1, keepdims=True)) @ unit[:2000].T  # part 1 filtered out
    expected = np.argsort(-scores, axis=1)[:, :10]
    for name in ("one", "many"):
        found = json.loads((tmp_path / f"{name}.json").read_text())
        assert [[n["row"] for n in q["neighbours"]] for q in found] == expected.tolist()
        for query, row in zip(found, scores):
            np.testing.assert_allclose([n["cosine"] for n in query["neighbours"]], np.sort(row)[::-1][:10], atol=1e-5)
    near = run_cli(2, "circuits", "similar", path, "--to", "part1/7", "-k", 3, "--json", tmp_path / "to.json")
    assert_ok(near)
    to = json.loads((tmp_path / "to.json").read_text())[0]["neighbours"]
    own = unit[2007] @ unit.T
    own[2007] = -np.inf
    assert [n["row"] for n in to] == list(np.argsort(-own)[:3])
    # Many identical vectors (ties) and k beyond what passes the filter: each row's cosine must be the same bits
    # wherever it sits in a block and on whichever rank, and ties go to the smaller row, so 1 and 2 ranks agree.
    twins = tmp_path / "twins.h5"
    kinds = rng.standard_normal((6, 24))
    picked = rng.integers(0, 6, 3000)
    add_circuits(str(twins), NewCircuits(model, "", [f"t/{j}" for j in range(3000)], rng.standard_normal((3000, 5)),
                                         "test", embeddings=kinds[picked], space="twins",
                                         fields={"bucket": (np.arange(3000) % 3).tolist()}))  # fmt: skip
    np.save(tmp_path / "near.npy", kinds + 0.3 * rng.standard_normal((6, 24)))
    args = ["circuits", "similar", twins, "--vector", tmp_path / "near.npy", "-k", 1500, "--where", "bucket!=1"]
    assert_ok(run_alone(*args, "--json", tmp_path / "t1.json"))
    assert_ok(run_cli(2, *args, "--json", tmp_path / "t2.json", timeout=90))
    alone, spread = (json.loads((tmp_path / f"t{n}.json").read_text()) for n in (1, 2))
    assert alone == spread
    for query in alone:
        pairs = [(-n["cosine"], n["row"]) for n in query["neighbours"]]
        assert pairs == sorted(pairs) and len(pairs) == 1500  # cosine descending, ties by row
        assert len({n["cosine"] for n in query["neighbours"]}) <= 6  # identical vectors: one cosine each kind
    zero = np.zeros((1, 24))
    np.save(tmp_path / "zero.npy", zero)
    refused = run_cli(2, "circuits", "similar", path, "--vector", tmp_path / "zero.npy", timeout=60)
    assert refused.returncode == 2 and "is all zeros" in refused.stderr


def expected_features(pipeline: Path, inputs: np.ndarray) -> np.ndarray:
    """Every circuit of ``build_catalogue`` computed here: the models in torch, the projections in numpy."""
    net, _ = load_trained(str(pipeline / "model.h5"))
    columns = []
    with torch.no_grad():
        x = torch.from_numpy(inputs)
        for layer, upto in (("relu1", 3), ("relu2", 5)):
            with h5py.File(pipeline / f"{layer}.h5", "r") as file:
                columns.append(net[:upto](x).numpy() @ file["dictionary"][()].T)
        with h5py.File(pipeline / "projections.h5", "r") as file:
            columns.append(Small().eval()(x).numpy() @ file["P"][()].T)
        columns.append(Heavy().eval()(x).numpy())
    return np.concatenate(columns, axis=1)


def digits(pipeline: Path) -> np.ndarray:
    with h5py.File(pipeline / "model.digits.h5", "r") as file:
        return file["inputs"][()]


def test_run_all_features_equals_the_models_on_2_ranks(pipeline, built, tmp_path):
    """Every circuit on the digits, 2 ranks in batches of 100 (a last short batch): each column equals the circuit
    computed in this process; a filtered run keeps the catalogue's column order; a changed model is refused."""
    data = f"{pipeline / 'model.digits.h5'}:/inputs"
    out = tmp_path / "f.h5"
    job = run_cli(2, "circuits", "run", "--catalogue", built, "--data", data, "--out", out, "--all-features",
                  "--batch-size", 100, timeout=120)  # fmt: skip
    assert_ok(job)
    assert "wrote" in job.stdout and "25 circuits of 3 models on 1437 inputs" in job.stdout
    expected = expected_features(pipeline, digits(pipeline))
    with h5py.File(out, "r") as file:
        assert file.attrs["format"] == "mpiscale.circuit-features/1"
        np.testing.assert_allclose(file["features"][()], expected, rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(file["sample_ids"][()], np.arange(1437))
        assert file["done"][()].all() and file["circuits"][-1] == b"heavy/5"
        assert file.attrs["device"] == "cpu"  # auto, on a machine without a GPU
    shown = run_alone("inspect", out)
    assert_ok(shown)
    assert f"of the catalogue {built} on 1,437 inputs of {data}, 2 ranks (cpu)" in shown.stdout, shown.stdout
    assert "batches: all 15 written (--batch-size 100)\n/features: 1,437 x 25 (25 circuits)" in shown.stdout
    names = [name.decode() for name in h5py.File(out, "r")["circuits"][()]]
    most = int(np.argmax(np.abs(expected).mean(axis=0)))
    assert f"most active over the written rows (mean |value|): {names[most]} " in shown.stdout, shown.stdout
    some = tmp_path / "some.h5"
    assert_ok(run_alone("circuits", "run", "--catalogue", built, "--data", data, "--out", some, "--all-features",
                        "--where", "tag=digits;atom>=3"))  # fmt: skip
    with h5py.File(some, "r") as file:
        rows = file["circuit_rows"][()]
        assert list(rows) == [*range(3, 10), *range(13, 16)]
        np.testing.assert_allclose(file["features"][()], expected[:, rows], rtol=1e-4, atol=1e-4)
    empty = run_alone("circuits", "run", "--catalogue", built, "--data", data, "--out", tmp_path / "no.h5",
                      "--all-features", "--where", ";")  # fmt: skip
    assert empty.returncode == 2 and "--where ';' holds no filter" in empty.stderr, empty.stderr


def test_circuits_of_a_model_trained_on_float64_readings_see_their_digits_as_collect_does(tmp_path):
    """Readings of 1e4 +- 1e-3 (float64): the model standardises them before any rounding in training and collect,
    and so in circuits run, whose features equal the float64 model's. Cast to float32 first, as circuits run did,
    every reading was one of a few levels."""
    rng = np.random.default_rng(0)
    readings = 1e4 + 1e-3 * rng.standard_normal((2000, 2))
    with h5py.File(tmp_path / "sensors.h5", "w") as file:
        file["inputs"] = readings
        file["labels"] = (readings[:, 0] > 1e4).astype(np.int64)
    model, acts, learned, catalogue = (tmp_path / name for name in ("model.h5", "acts.h5", "d.h5", "c.h5"))
    assert_ok(run_alone("train", "--data", tmp_path / "sensors.h5", "--epochs", 1, "--hidden", 8, "--out", model,
                        "--progress-every", 0))  # fmt: skip
    assert_ok(run_alone("collect", "--model", model, "--layers", "hidden1", "--out", acts))
    assert_ok(run_alone("dictlearn", "--data", f"{acts}:/hidden1", "--atoms", 4, "--sparsity", 1, "--iterations",
                        20, "--out", learned, "--progress-every", 0))  # fmt: skip
    assert_ok(run_alone("circuits", "add", catalogue, "--dictlearn", learned))
    out = tmp_path / "f.h5"
    assert_ok(run_cli(2, "circuits", "run", "--catalogue", catalogue, "--data", f"{tmp_path / 'sensors.h5'}:/inputs",
                      "--out", out, "--all-features", timeout=120))  # fmt: skip
    net, _ = load_trained(str(model))
    with torch.no_grad(), h5py.File(learned, "r") as file:
        expected = net[:2](torch.from_numpy(readings)).numpy() @ file["dictionary"][()].T
    with h5py.File(out, "r") as file:
        np.testing.assert_allclose(file["features"][()], expected, rtol=1e-4, atol=1e-4)
        assert len(np.unique(file["features"][:, 0])) > 1000  # not a few levels


def test_circuits_run_on_a_real_gpu_gives_the_cpus_features(pipeline, built, tmp_path):
    """--all-features with --device cuda on one rank, and on 2 ranks sharing the GPU on purpose: the columns this
    process computes on the CPU (skipped without a GPU; make gpu-check runs it)."""
    if not real_torch_gpu():
        pytest.skip("torch sees no CUDA GPU (make gpu-check runs this where there is one)")
    data = f"{pipeline / 'model.digits.h5'}:/inputs"
    expected = expected_features(pipeline, digits(pipeline))
    for ranks, env in gpu_ranks():
        name = f"gpu{ranks}.h5"
        job = run_cli(ranks, "circuits", "run", "--catalogue", built, "--data", data, "--out", tmp_path / name,
                      "--all-features", "--device", "cuda", env=env, timeout=120)  # fmt: skip
        assert_ok(job)
        with h5py.File(tmp_path / name, "r") as file:
            assert on_a_gpu(file.attrs), file.attrs["device"]
            np.testing.assert_allclose(file["features"][()], expected, rtol=1e-4, atol=1e-4)


def test_a_stopped_and_a_killed_run_resume_at_their_last_written_batch(pipeline, tmp_path):
    """The slow exported module over 600 digits in batches of 20 on 2 ranks. SIGTERM after a few steps keeps
    OUT.partial; a plain rerun and a resume with another batch size are refused and leave it as it was; --resume on
    3 ranks finishes. A rank SIGKILLed mid-run ends the job, OUT.tmp keeps the flagged batches, and --resume on 1
    rank finishes. Both equal the module run here."""
    path = tmp_path / "slow.h5"
    heavy = ModelRef.of(str(pipeline / "heavy.pt2"), "export", DIGITS, "float32")  # added here: the command is tested
    add_circuits(str(path), NewCircuits(heavy, "", [f"heavy/{j}" for j in range(6)], np.eye(6), "test"))
    inputs = digits(pipeline)[:600]  # 30 batches of 20: enough steps to stop in the middle
    with h5py.File(tmp_path / "some.h5", "w") as file:
        file["X"] = inputs
    data = f"{tmp_path / 'some.h5'}:/X"
    with torch.no_grad():
        expected = Heavy().eval()(torch.from_numpy(inputs)).numpy()
    common = ["circuits", "run", "--catalogue", str(path), "--data", data, "--all-features", "--batch-size", "20"]

    out, partial, log = tmp_path / "stopped.h5", tmp_path / "stopped.h5.partial", tmp_path / "stopped.log"
    with open(log, "w") as stdout:
        process = launch(2, [sys.executable, "-m", "mpiscale.cli", *common, "--out", str(out), "--progress-every",
                             "0.001"], stdout=stdout)  # fmt: skip
        with held_at_step(process, log, str(out), "step", 3) as (ranks, _):
            interrupt(ranks, "stopped")
        stopped = finish(process, "circuits run after SIGTERM", 60)
    assert "SIGTERM received, stopping after the current step" in stopped.stderr, stopped.stderr[-3000:]
    assert partial.exists() and not out.exists() and not Path(f"{out}.tmp").exists()
    with h5py.File(partial, "r") as file:
        done = int(file["done"][()].sum())
    assert 2 <= done < 30, done
    shown = run_alone("inspect", partial)
    assert f"batches: {done} of 30 written (--batch-size 20); mpiscale circuits run --resume --out {out}," in (
        shown.stdout), shown.output  # fmt: skip
    learn = run_alone("dictlearn", "--data", f"{partial}:/features", "--atoms", "4", "--sparsity", "2",
                      "--out", tmp_path / "d.h5")  # fmt: skip
    refusal = f"holds {done} of its 30 batches, an unfinished run's (the others hold nothing yet): mpiscale circuits"
    assert learn.returncode == 2 and refusal in learn.stderr, learn.stderr  # (it learned from their zeros)
    before = partial.read_bytes()
    plain = run_cli(2, *common, "--out", out)  # decided on rank 0, said by every rank: one line, not an abort
    assert plain.returncode == 2 and "pass --resume" in plain.stderr, plain.output[-3000:]
    assert plain.stderr.count("\n") == 1 and "aborting" not in plain.stderr, plain.stderr
    other = run_alone(*common[:-1], "30", "--out", out, "--resume")
    assert other.returncode == 2 and "batch_size: stopped run 20, now 30" in other.stderr
    assert partial.read_bytes() == before
    resumed = run_cli(3, *common, "--out", out, "--resume", timeout=120)
    assert_ok(resumed)
    assert f"resumed from {partial}: {done} of 30 batches were written" in resumed.stdout
    with h5py.File(out, "r") as file:
        np.testing.assert_allclose(file["features"][()], expected, rtol=1e-4, atol=TANH_CHAIN_ATOL)
        assert file["done"][()].all()

    out, log = tmp_path / "killed.h5", tmp_path / "killed.log"
    with open(log, "w") as stdout:
        process = launch(2, [sys.executable, "-m", "mpiscale.cli", *common, "--out", str(out), "--progress-every",
                             "0.001"], stdout=stdout)  # fmt: skip
        with held_at_step(process, log, str(out), "step", 3) as (ranks, _):
            interrupt(ranks, "killed")
        killed = finish(process, "circuits run with a rank killed", 60)
    assert killed.returncode != 0
    kept = Path(f"{out}.tmp")
    assert kept.exists() and not out.exists()
    with h5py.File(kept, "r") as file:
        flagged = file["done"][()].astype(bool)
        assert 2 <= flagged.sum() < 30
        rows = np.concatenate([np.arange(b * 20, b * 20 + 20) for b in np.flatnonzero(flagged)])
        np.testing.assert_allclose(file["features"][()][rows], expected[rows], rtol=1e-4, atol=TANH_CHAIN_ATOL)
    resumed = run_alone(*common, "--out", out, "--resume")
    assert_ok(resumed)
    with h5py.File(out, "r") as file:
        np.testing.assert_allclose(file["features"][()], expected, rtol=1e-4, atol=TANH_CHAIN_ATOL)


def test_a_resume_refuses_data_written_again_with_other_values_in_its_written_batches(pipeline, tmp_path):
    """A run on 2 ranks meets a NaN in batch 7 and keeps batches 0-5. The data written again with the NaN fixed
    and one value of batch 2 changed is refused, naming the batch's rows, and leaves the kept file as it was; the
    data written again as it was resumes on 3 ranks to the features of the clean data. A kept file of a version
    without digests resumes too."""
    small = ModelRef.of(str(pipeline / "small.pt"), "torchscript", DIGITS, "float32")
    add_circuits(str(tmp_path / "c.h5"), NewCircuits(small, "", [f"s/{j}" for j in range(5)], np.eye(5), "test"))
    clean = digits(pipeline)[:1000].copy()

    def write(inputs: np.ndarray) -> None:
        with h5py.File(tmp_path / "d.h5", "w") as file:  # a user's preprocessing, run again
            file["X"] = inputs

    broken = clean.copy()
    broken[700, 5] = np.nan
    write(broken)
    common = ["circuits", "run", "--catalogue", tmp_path / "c.h5", "--data", f"{tmp_path / 'd.h5'}:/X",
              "--all-features", "--batch-size", 100, "--out", tmp_path / "f.h5"]  # fmt: skip
    failed = run_cli(2, *common, timeout=90)
    assert failed.returncode == 2 and "sample 700 gives NaN" in failed.stderr, failed.output[-3000:]
    kept = tmp_path / "f.h5.tmp"
    with h5py.File(kept, "r") as file:
        assert file["done"][()].tolist() == [1] * 6 + [0] * 4
    shutil.copy(kept, tmp_path / "older.h5.tmp")
    before = kept.read_bytes()

    changed = clean.copy()
    changed[250, 3] += 1.0 / 16  # one pixel of batch 2, written before
    write(changed)
    refused = run_cli(2, *common, "--resume", timeout=90)
    assert refused.returncode == 2, refused.output[-3000:]
    assert f"cannot be resumed on this data: rows 200..299 of {tmp_path / 'd.h5'}:/X differ from those its batch 2 " \
           "was computed from" in refused.stderr, refused.stderr  # fmt: skip
    assert refused.stderr.count("\n") == 1, refused.stderr
    assert kept.read_bytes() == before

    write(clean)
    resumed = run_cli(3, *common, "--resume", timeout=90)
    assert_ok(resumed)
    assert f"resumed from {kept}: 6 of 10 batches were written" in resumed.stdout
    with torch.no_grad():
        expected = Small().eval()(torch.from_numpy(clean)).numpy()
    with h5py.File(tmp_path / "f.h5", "r") as file:
        np.testing.assert_allclose(file["features"][()], expected, rtol=1e-5, atol=1e-6)

    with h5py.File(tmp_path / "older.h5.tmp", "a") as file:
        del file["data_digests"]  # as an earlier version wrote it
    older = run_alone(*common[:-1], tmp_path / "older.h5", "--resume")
    assert_ok(older)
    with h5py.File(tmp_path / "older.h5", "r") as file:
        np.testing.assert_allclose(file["features"][()], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("work", ["--all-features", "--plan"])
def test_rows_one_rank_cannot_read_end_the_run_on_every_rank_in_one_line(pipeline, tmp_path, work):
    """A user's checksummed data with a bit flipped in batch 7's chunk, which rank 1 reads: it raised alone while
    rank 0 waited for the step's agreement, and the job was aborted after 10 s with two tracebacks (status 1). The
    step fails on every rank with the file, the rows and HDF5's words (status 2); the batches before stay kept."""
    small = ModelRef.of(str(pipeline / "small.pt"), "torchscript", DIGITS, "float32")
    add_circuits(str(tmp_path / "c.h5"), NewCircuits(small, "", [f"s/{j}" for j in range(5)], np.eye(5), "test"))

    def damaged(chunk: int) -> None:
        with h5py.File(tmp_path / "d.h5", "w") as file:
            file.create_dataset("X", data=digits(pipeline)[:1000], chunks=(100, DIGITS), fletcher32=True)
        flip_a_bit(tmp_path / "d.h5", "X", chunk)

    damaged(7)
    (tmp_path / "plan.toml").write_text('outputs = ["out"]\n[[node]]\nname = "out"\ncircuits = "name=s/*"\n')
    chosen = ["--all-features"] if work == "--all-features" else ["--plan", tmp_path / "plan.toml", "--in-flight", 2]
    job = run_cli(2, "circuits", "run", "--catalogue", tmp_path / "c.h5", "--data", f"{tmp_path / 'd.h5'}:/X",
                  *chosen, "--batch-size", 100, "--out", tmp_path / "f.h5", timeout=60)  # fmt: skip
    assert job.returncode == 2 and "Traceback" not in job.output, job.output[-3000:]
    assert "rows 700..799 cannot be read (Can't read data (data error detected by Fletcher32 checksum))" in (
        job.stderr), job.stderr  # fmt: skip
    with h5py.File(tmp_path / "f.h5.tmp", "r") as file:
        assert file["done"][()][:6].all() and not file["done"][7]
    if work == "--all-features":  # the resume's check of the written batches reads them: rank 1 reads batch 3
        damaged(3)
        before = (tmp_path / "f.h5.tmp").read_bytes()
        resumed = run_cli(2, "circuits", "run", "--catalogue", tmp_path / "c.h5", "--data", f"{tmp_path / 'd.h5'}:/X",
                          *chosen, "--batch-size", 100, "--out", tmp_path / "f.h5", "--resume", timeout=60)  # fmt: skip
        assert resumed.returncode == 2 and "rows 300..399 cannot be read" in resumed.stderr, resumed.output[-3000:]
        assert resumed.stderr.count("\n") == 1 and (tmp_path / "f.h5.tmp").read_bytes() == before, resumed.stderr


PLAN = """
outputs = ["gate", "gap", "both"]

[[node]]
name = "shallow"
circuits = "layer=relu1;atom<4"

[[node]]
name = "deep"
circuits = ["model.relu2/atom0001", "model.relu2/atom0003"]

[[node]]
name = "user"
circuits = "tag=slow"
rank = 2

[[node]]
name = "both"
op = "concat"
inputs = ["shallow", "deep"]

[[node]]
name = "head"
op = "linear"
inputs = ["both"]
weights = "head.h5:/W"
bias = "bias.npy"

[[node]]
name = "gate"
op = "sigmoid"
inputs = ["head"]

[[node]]
name = "gap"
op = "subtract"
inputs = ["head", "user"]
"""


def test_a_plan_runs_compiled_over_3_ranks_as_it_means_and_refuses_what_cannot_run(pipeline, built, tmp_path):
    """Circuits of two layers of one model (one model node: its shared prefix runs once per batch), a user's
    module pinned to rank 2, and ops on user-written weights: each output equals the plan computed here from the
    models; plans that cannot run are refused with every problem in one message, before any output exists."""
    rng = np.random.default_rng(3)
    weights, bias = rng.standard_normal((6, 6)), rng.standard_normal(6)
    with h5py.File(tmp_path / "head.h5", "w") as file:
        file["W"] = weights
    np.save(tmp_path / "bias.npy", bias)
    (tmp_path / "plan.toml").write_text(PLAN)
    data, out = f"{pipeline / 'model.digits.h5'}:/inputs", tmp_path / "plan.h5"
    job = run_cli(3, "circuits", "run", "--catalogue", built, "--data", data, "--plan", tmp_path / "plan.toml",
                  "--out", out, "--batch-size", 128, timeout=120)  # fmt: skip
    assert_ok(job)
    assert "plan of 9 nodes on 3 ranks" in job.stdout  # 7 of the plan, a node per model
    every = expected_features(pipeline, digits(pipeline))  # the catalogue's 25 columns
    both = np.concatenate([every[:, :4], every[:, [11, 13]]], axis=1)
    head = both @ weights.T + bias
    with h5py.File(out, "r") as file:
        nodes = [n.decode() for n in file["plan/nodes"][()]]
        assert nodes.count("model:0") == 1 and "model:2" in nodes  # one node per model, whatever reads it
        assert file["plan/ranks"][nodes.index("user")] == 2
        np.testing.assert_allclose(file["outputs/both"][()], both, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(file["outputs/gate"][()], 1 / (1 + np.exp(-head)), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(file["outputs/gap"][()], head - every[:, 19:25], rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(file["sample_ids"][()], np.arange(1437))

    cycle = PLAN.replace('inputs = ["head", "user"]', 'inputs = ["gap", "user"]').replace('"gap", "both"', '"gone"')
    shapes = PLAN.replace('"model.relu2/atom0003"', '"model.relu2/atom0099"').replace('"head.h5:/W"', '"bias.npy"')
    cases = {
        "cycle": (cycle, ["nodes gap -> gap form a cycle", "output 'gone' is not a node"]),
        "shapes": (shapes, ["the catalogue has no circuit 'model.relu2/atom0099'", "bias has 6 numbers for 1 outputs",
                            "subtract takes inputs of one width, got head (1), user (6)"]),
    }  # fmt: skip
    bad = weights.copy()
    bad[2, 3] = np.nan
    np.save(tmp_path / "nan.npy", bad)
    cases["factor"] = (PLAN.replace('op = "sigmoid"', 'op = "scale"\nfactor = 1e39'),
                       ["node 'gate': factor must be a finite number within float32's range"])  # fmt: skip
    cases["nan"] = (PLAN.replace('"head.h5:/W"', '"nan.npy"'), ["node 'head': weights hold nan at (2, 3)"])
    cases["pinned"] = (PLAN, ["node 'user' is placed on rank 2, but the job has 1 rank"])
    for name, (text, messages) in cases.items():
        (tmp_path / f"{name}.toml").write_text(text)
        refused = run_alone("circuits", "run", "--catalogue", built, "--data", data, "--plan",
                            tmp_path / f"{name}.toml", "--out", tmp_path / "no.h5")  # fmt: skip
        assert refused.returncode == 2 and all(m in refused.stderr for m in messages), refused.stderr
    far = run_cli(2, "circuits", "run", "--catalogue", built, "--data", data, "--plan", tmp_path / "nan.toml",
                  "--out", tmp_path / "no.h5", timeout=60)  # fmt: skip
    assert far.returncode == 2 and "weights hold nan" in far.stderr and far.stderr.count("\n") == 1, far.stderr
    assert not (tmp_path / "no.h5").exists() and not (tmp_path / "no.h5.tmp").exists()  # only its telemetry file


class Picky(torch.nn.Module):
    """A user's module that refuses inputs it was not made for (values over 1e6)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x > 1e6).any()):
            raise RuntimeError("a value over 1e6: not a digit")
        return x[:, :3]


def test_a_node_failing_on_one_rank_ends_the_plan_on_every_rank_with_its_message(pipeline, tmp_path):
    """A user's module raises on one batch in its model's node on rank 0; the failure travels in place of the value
    along the edges to the nodes on rank 1: the job ends at once with exit 2 and the node's message, and keeps the
    batches written before. Data with a value changed in a written batch is refused; with the data cleaned,
    --resume on 3 ranks places the plan anew and finishes it."""
    torch.jit.save(torch.jit.script(Picky()), tmp_path / "picky.pt")
    model = ModelRef.of(str(tmp_path / "picky.pt"), "torchscript", DIGITS, "float32")
    add_circuits(str(tmp_path / "c.h5"), NewCircuits(model, "", ["p0", "p1", "p2"], np.eye(3), "test"))
    inputs = digits(pipeline).copy()
    inputs[700, 5] = 1e7
    with h5py.File(tmp_path / "d.h5", "w") as file:
        file["X"] = inputs
    np.save(tmp_path / "w.npy", np.ones((2, 3)))
    plan = """outputs = ["out"]
[[node]]
name = "probe"
circuits = "name=p*"
[[node]]
name = "head"
op = "linear"
inputs = ["probe"]
weights = "w.npy"
[[node]]
name = "out"
op = "relu"
inputs = ["head"]
"""  # placed by cost: the model and probe on rank 0, head and out on rank 1 (on 3 ranks: otherwise)
    (tmp_path / "plan.toml").write_text(plan)
    data = f"{tmp_path / 'd.h5'}:/X"
    job = run_cli(2, "circuits", "run", "--catalogue", tmp_path / "c.h5", "--data", data, "--plan",
                  tmp_path / "plan.toml", "--out", tmp_path / "o.h5", "--batch-size", 100, timeout=60)  # fmt: skip
    assert job.returncode == 2, job.output[-3000:]
    # the module runs in its model's node, placed on rank 0; its failure reached rank 1's nodes
    assert "node 'model:0' (picky.pt) on batch 7" in job.stderr and "not a digit" in job.stderr, job.stderr
    with h5py.File(tmp_path / "o.h5.tmp", "r") as file:
        placed = dict(zip((n.decode() for n in file["plan/nodes"][()]), file["plan/ranks"][()].tolist()))
        assert placed == {"model:0": 0, "probe": 0, "head": 1, "out": 1}, placed
    with h5py.File(tmp_path / "o.h5.tmp", "r") as file:
        done = file["done"][()]
        assert done[:4].all() and not done[7]  # the steps before the failing one are kept for --resume
    resume = ["circuits", "run", "--catalogue", tmp_path / "c.h5", "--data", data, "--plan", tmp_path / "plan.toml",
              "--out", tmp_path / "o.h5", "--batch-size", 100, "--resume"]  # fmt: skip
    other = inputs.copy()
    other[399, 0] += 1  # a value of a batch written (the last row of batch 3): other data, refused
    with h5py.File(tmp_path / "d.h5", "w") as file:
        file["X"] = other
    refused = run_cli(2, *resume, timeout=90)
    assert refused.returncode == 2 and "rows 300..399" in refused.stderr, refused.output[-3000:]
    inputs[700, 5] = 0.0  # the data cleaned: the plan resumes on 3 ranks, placed anew (the batches are global)
    with h5py.File(tmp_path / "d.h5", "w") as file:
        file["X"] = inputs
    resumed = run_cli(3, *resume, timeout=90)
    assert_ok(resumed)
    with h5py.File(tmp_path / "o.h5", "r") as file:
        np.testing.assert_allclose(file["outputs/out"][()], inputs[:, :3].sum(axis=1, keepdims=True).repeat(2, 1),
                                   rtol=1e-5, atol=1e-4)  # fmt: skip
        assert len(set(file["plan/ranks"][()].tolist())) == 3  # where this run placed the nodes: on its 3 ranks
