"""`mpiscale compress-adapters` under real mpirun, on adapters written the ways users write them.

Planted adapters (a known shared subspace plus noise, saved with safetensors' numpy API)
check the components against numpy's exact decomposition of every adapter stacked, the
angle to the planted subspace and each adapter's error against its update rebuilt here,
on 1, 2 and 4 ranks. Adapters saved by peft itself are rebuilt
exactly when every component is kept.
"""

import json

import h5py
import numpy as np
import pytest
from adapter_files import peft_adapters, read_adapter
from helpers import assert_ok, gpu_ranks, on_a_gpu, real_torch_gpu
from test_train import mpiscale

from mpiscale.adapters.files import write_adapter
from mpiscale.adapters.planted import MODULES, lora_config, write_planted

COUNT, RANK, SHARED = 15, 4, 6


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("planted")
    bases = write_planted(root / "adapters", COUNT, RANK, shared=SHARED)
    stacked = {}
    for module in MODULES:
        weights = [read_adapter(root / "adapters" / f"task-{i}") for i in range(COUNT)]
        stacked[module] = (np.concatenate([w[f"{module}.lora_A.weight"] for w in weights]),
                           np.concatenate([w[f"{module}.lora_B.weight"].T for w in weights]))  # fmt: skip
    return root, bases, stacked


def compressed(path) -> dict:
    with h5py.File(path, "r") as file:
        out = {"modules": [m.decode() for m in file["modules"][()]], "error": file["adapters/error"][()],
               "names": [n.decode() for n in file["adapters/name"][()]]}  # fmt: skip
        for index in range(len(out["modules"])):
            group = file[f"groups/{index:04d}"]
            out[index] = {key: group[key][()] for key in ("A/components", "A/loadings", "A/explained", "B/components",
                                                           "B/loadings", "B/explained", "error")}  # fmt: skip
        return out


@pytest.mark.parametrize(
    "ranks, options",
    [(2, ["--components", SHARED]), (4, ["--components", SHARED, "--method", "randomized"]), (1, ["--variance", 0.6])],
)  # fmt: skip
def test_components_match_numpy_and_the_planted_subspace_on_any_number_of_ranks(adapters, tmp_path, ranks, options):
    """Exact, the range finder (4 ranks: blocks of 4, 4, 4 and 3 adapters) and the fewest components that explain
    60%: what numpy's decomposition of every adapter stacked explains, and each adapter's error as rebuilt here."""
    root, bases, stacked = adapters
    out = tmp_path / "c.h5"
    job = mpiscale(ranks, "compress-adapters", "--adapters", root / "adapters", *options, "--out", out)
    assert_ok(job)
    assert f"wrote {out}: {COUNT} adapters, 2 layer groups" in job.stdout
    with h5py.File(out, "r") as file:
        assert file.attrs["device"] == "cpu"  # auto, on a machine without a GPU
    records = [json.loads(line) for line in (tmp_path / "c.h5.telemetry.jsonl").read_text().splitlines()]
    assert [p["detail"] for p in records if p["kind"] == "event" and p["event"] == "device"] == ["cpu"]
    got = compressed(out)
    assert got["modules"] == list(MODULES) and got["names"] == [f"task-{i}" for i in range(COUNT)]
    updates, rebuilt = np.zeros(COUNT), np.zeros(COUNT)
    for index, module in enumerate(MODULES):
        group = got[index]
        for side, rows, basis in (
            ("A", stacked[module][0], bases[module][0]),
            ("B", stacked[module][1], bases[module][1]),
        ):
            squares = np.linalg.svd(rows, compute_uv=False) ** 2
            share = squares / squares.sum()
            kept = SHARED if "--components" in options else int(np.argmax(np.cumsum(share) >= 0.6)) + 1
            np.testing.assert_allclose(group[f"{side}/explained"], share[:kept], rtol=1e-6)
            if kept == SHARED:
                cosines = np.linalg.svd(basis @ group[f"{side}/components"].T.astype(np.float64), compute_uv=False)
                assert cosines.min() > 0.9999, cosines  # the largest principal angle to the planted subspace
        for i in range(COUNT):
            a, b_t = stacked[module][0][i * RANK : (i + 1) * RANK], stacked[module][1][i * RANK : (i + 1) * RANK]
            update = b_t.T @ a
            a_rebuilt = group["A/loadings"][i] @ group["A/components"]
            b_rebuilt = (group["B/loadings"][i] @ group["B/components"]).T
            error = np.linalg.norm(update - b_rebuilt @ a_rebuilt) / np.linalg.norm(update)
            assert error == pytest.approx(group["error"][i], rel=1e-3, abs=1e-7)
            updates[i] += np.linalg.norm(update) ** 2
            rebuilt[i] += np.linalg.norm(update - b_rebuilt @ a_rebuilt) ** 2
    np.testing.assert_allclose(got["error"], np.sqrt(rebuilt / updates), rtol=1e-3)
    if "--components" in options:
        assert got["error"].max() < 0.01  # noise 1e-3 against weights of order 1


def test_adapters_saved_by_peft_are_rebuilt_exactly_with_every_component(tmp_path):
    """Random adapters of a tiny Llama saved by peft, and one of them saved again in bfloat16 as a user might: with
    every component kept (12 rows in 32 dimensions: the Gram path) each adapter's matrices come back, and one
    exported in the PEFT format loads with PeftModel and gives the original adapter's outputs."""
    pytest.importorskip("peft", reason="pip install peft (the test extras) to write adapters with peft itself")
    import torch
    from safetensors.torch import load_file, save_file

    directory = peft_adapters(tmp_path, 3, RANK)
    half = directory / "task-bf16"
    half.mkdir()
    weights = load_file(directory / "task-0" / "adapter_model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, str(half / "adapter_model.safetensors"))
    (half / "adapter_config.json").write_text((directory / "task-0" / "adapter_config.json").read_text())
    out = tmp_path / "c.h5"
    every = mpiscale(2, "compress-adapters", "--adapters", directory, "--variance", 1.0, "--out", out)
    assert_ok(every)  # 16 components per side of 16 rows outgrow the adapters: said, with the cap that does not
    assert "WARNING: the compressed file holds 150.0% of the adapters' parameters" in every.stderr, every.stderr
    assert "--max-components 10 or fewer" in every.stderr
    capped = mpiscale(
        1, "compress-adapters", "--adapters", directory, "--max-components", 10, "--out", tmp_path / "k.h5"
    )
    assert_ok(capped)
    assert "93.8% of the parameters" in capped.stdout and "WARNING" not in capped.stderr, capped.output[-2000:]
    got = compressed(out)
    assert got["names"] == ["task-0", "task-1", "task-2", "task-bf16"] and len(got["modules"]) == 4  # 2 layers x q, v
    assert got["modules"][0] == "base_model.model.model.layers.0.self_attn.q_proj"
    assert got["error"].max() < 1e-6
    for i, name in enumerate(got["names"]):
        original = read_adapter(directory / name)
        for index, module in enumerate(got["modules"]):
            group = got[index]
            np.testing.assert_allclose(group["A/loadings"][i] @ group["A/components"],
                                       original[f"{module}.lora_A.weight"], atol=1e-5)  # fmt: skip
            np.testing.assert_allclose((group["B/loadings"][i] @ group["B/components"]).T,
                                       original[f"{module}.lora_B.weight"], atol=1e-5)  # fmt: skip
    report = mpiscale(1, "inspect", out)
    assert_ok(report)
    assert "4 LoRA adapters of rank 4 on base model " in report.stdout
    assert "4 layer groups (computed on cpu)" in report.stdout
    from mpiscale.adapters.results import figure  # inspect --plot's picture: each group named in its legend

    legend = figure(str(out)).axes[1].get_legend()
    assert [text.get_text() for text in legend.get_texts()] == list(got["modules"]), legend

    from mpiscale.cli import main

    exported = tmp_path / "task-1-rebuilt"
    assert main(["compress-adapters", "export", str(out), "task-1", "--to", str(exported)]) == 0
    assert main(["compress-adapters", "export", str(out), "task-1", "--to", str(exported)]) == 2  # exists: refused
    assert main(["compress-adapters", "export", str(out), "task-9", "--to", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    tokens = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    logits = []
    for adapter in (directory / "task-1", exported):
        model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(tmp_path / "base"), adapter).eval()
        with torch.no_grad():
            logits.append(model(tokens).logits)
    assert (logits[0] - logits[1]).abs().max().item() < 1e-4


def test_adapters_peft_saved_as_pytorch_pickles_compress_as_their_safetensors_twins_do(tmp_path):
    """PEFT before 0.6 (and ``save_pretrained(safe_serialization=False)``) saves adapter_model.bin, a PyTorch
    pickle, as most adapters on the Hub from 2023 are: they were refused ("adapter_model.safetensors: cannot read
    it: No such file or directory"). The same adapters compress to the same file either way, and mixed."""
    pytest.importorskip("peft", reason="pip install peft (the test extras) to write adapters with peft itself")
    safe = peft_adapters(tmp_path, 3, RANK).rename(tmp_path / "safe")  # (the same base model, the same seeds)
    pickled = peft_adapters(tmp_path, 3, RANK, safe_serialization=False)
    assert sorted(path.name for path in (pickled / "task-0").iterdir()) == [
        "README.md", "adapter_config.json", "adapter_model.bin"]  # fmt: skip
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for name, directory in (("task-0", pickled), ("task-1", safe), ("task-2", pickled)):
        (mixed / name).symlink_to(directory / name)
    got = {}
    for name, directory in (("safe", safe), ("pickled", pickled), ("mixed", mixed)):
        out = tmp_path / f"{name}.h5"
        assert_ok(mpiscale(2, "compress-adapters", "--adapters", directory, "--components", 4, "--out", out))
        got[name] = compressed(out)
    for name in ("pickled", "mixed"):
        assert got[name]["names"] == got["safe"]["names"] and got[name]["modules"] == got["safe"]["modules"]
        for index in range(len(got["safe"]["modules"])):
            for key, array in got["safe"][index].items():
                np.testing.assert_array_equal(got[name][index][key], array, err_msg=f"{name} {index} {key}")


def test_a_mismatched_adapter_or_nan_weights_end_the_job_naming_the_adapter(adapters, tmp_path):
    """Checked from the headers before any group is read (a rank of 8 among rank 4); NaN found when its group is
    read. Exit status 2, one message, no output file left; an output that would replace an input is refused."""
    root, _, _ = adapters
    mixed = tmp_path / "mixed"
    write_planted(mixed, 3, RANK)
    rng = np.random.default_rng(5)
    tensors = {f"{m}.lora_A.weight": rng.standard_normal((8, 64)).astype(np.float32) for m in MODULES}
    tensors |= {f"{m}.lora_B.weight": rng.standard_normal((48, 8)).astype(np.float32) for m in MODULES}
    write_adapter(mixed / "task-3", tensors, lora_config(8))
    out = tmp_path / "c.h5"
    job = mpiscale(2, "compress-adapters", "--adapters", mixed, "--out", out)
    assert job.returncode == 2 and not out.exists(), job.stderr[-2000:]
    assert f"{mixed / 'task-3'}: rank 8, another than {mixed / 'task-0'} (rank 4)" in job.stderr
    assert job.stderr.count("mpiscale compress-adapters:") == 1, job.stderr

    broken = tmp_path / "broken"
    write_planted(broken, 3, RANK)
    nan = {key: value for key, value in read_adapter(broken / "task-2").items()}
    nan[f"{MODULES[1]}.lora_A.weight"][0, 0] = np.nan
    (broken / "task-2" / "adapter_model.safetensors").unlink()
    from safetensors.numpy import save_file

    save_file({k: v.astype(np.float32) for k, v in nan.items()}, str(broken / "task-2" / "adapter_model.safetensors"))
    job = mpiscale(2, "compress-adapters", "--adapters", broken, "--out", out)
    assert job.returncode == 2 and not out.exists() and not (tmp_path / "c.h5.tmp").exists(), job.stderr[-2000:]
    assert f"task-2/adapter_model.safetensors: {MODULES[1]} holds NaN or infinite values" in job.stderr
    # found by rank 1 alone (rank 0 holds task-0 and task-1): rank 0 left its lock behind, and the next run warned
    # that it took over the lock of a job that ended without releasing it
    assert not (tmp_path / "c.h5.lock").exists(), sorted(tmp_path.iterdir())

    inside = root / "adapters" / "task-0" / "adapter_model.safetensors"
    job = mpiscale(1, "compress-adapters", "--adapters", root / "adapters", "--out", inside)
    assert job.returncode == 2 and "adapter_model.safetensors" in job.stderr
    assert read_adapter(root / "adapters" / "task-0")  # still there, still readable

    folder = tmp_path / "results"  # an existing directory as --out: refused before any group is compressed
    folder.mkdir()
    job = mpiscale(2, "compress-adapters", "--adapters", root / "adapters", "--out", folder)
    assert job.returncode == 2 and f"the results file {folder} is a directory" in job.stderr, job.stderr[-2000:]
    assert job.stderr.count("\n") == 1 and list(folder.iterdir()) == [], job.stderr[-2000:]


def test_cuda_without_a_gpu_is_refused_in_one_line(adapters, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the refusal is for machines without one")
    root, _, _ = adapters
    out = tmp_path / "c.h5"
    job = mpiscale(2, "compress-adapters", "--adapters", root / "adapters", "--device", "cuda", "--out", out)
    assert job.returncode == 2 and job.stderr.count("\n") == 1, job.output[-3000:]
    assert "choosing the device failed: ranks 0-1: ValueError: --device cuda: torch sees no CUDA GPU" in job.stderr
    assert not out.exists()


@pytest.mark.parametrize("precision", ["float64", "float32"])
def test_adapters_on_a_real_gpu_give_the_cpus_components(adapters, tmp_path, precision):
    """--device cuda on one rank, and on 2 ranks sharing the GPU on purpose, against the CPU: the same components
    (signs are fixed), shares and errors (skipped without a GPU; make gpu-check runs it)."""
    if not real_torch_gpu():
        pytest.skip("torch sees no CUDA GPU (make gpu-check runs this where there is one)")

    root, _, _ = adapters
    common = ("compress-adapters", "--adapters", root / "adapters", "--components", SHARED)
    assert_ok(mpiscale(1, *common, "--device", "cpu", "--out", tmp_path / "cpu.h5"))
    written = []
    for ranks, env in gpu_ranks():
        written.append(f"gpu{ranks}.h5")
        assert_ok(mpiscale(ranks, *common, "--device", "cuda", "--precision", precision, "--out",
                           tmp_path / written[-1], env=env))  # fmt: skip
    cpu = compressed(tmp_path / "cpu.h5")
    for name in written:
        with h5py.File(tmp_path / name, "r") as file:
            assert on_a_gpu(file.attrs), file.attrs["device"]
        gpu = compressed(tmp_path / name)
        np.testing.assert_allclose(gpu["error"], cpu["error"], rtol=1e-4, atol=1e-7)
        for index in range(len(cpu["modules"])):
            for key in ("A/components", "B/components"):
                np.testing.assert_allclose(gpu[index][key], cpu[index][key], atol=1e-5)
            for key in ("A/explained", "B/explained"):
                np.testing.assert_allclose(gpu[index][key], cpu[index][key], rtol=1e-6)
