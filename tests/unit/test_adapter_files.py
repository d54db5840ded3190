"""Reading LoRA adapters: finding them, refusing what would be compressed wrongly, bfloat16 and NaN."""

import re
import sys

import numpy as np
import pytest

from mpiscale.adapters import AdapterError, find_adapters, open_adapter
from mpiscale.adapters.files import check_alike, write_adapter
from mpiscale.adapters.planted import MODULES, lora_config, write_planted


def pair(rank: int = 4, inputs: int = 8, outputs: int = 6, module: str = MODULES[0]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {f"{module}.lora_A.weight": rng.standard_normal((rank, inputs)).astype(np.float32),
            f"{module}.lora_B.weight": rng.standard_normal((outputs, rank)).astype(np.float32)}  # fmt: skip


def test_adapters_are_found_in_a_directory_a_glob_or_a_list_in_natural_order(tmp_path):
    for index in (2, 10, 1):
        write_adapter(tmp_path / "runs" / f"task-{index}", pair(), lora_config(4))
    (tmp_path / "runs" / "notes").mkdir()  # not an adapter: skipped
    expected = [str(tmp_path / "runs" / f"task-{index}") for index in (1, 2, 10)]
    assert find_adapters(str(tmp_path / "runs")) == expected
    assert find_adapters(str(tmp_path / "runs" / "task-*")) == expected
    assert find_adapters(str(tmp_path / "runs" / "task-2")) == [expected[1]]
    listing = tmp_path / "mine.txt"
    listing.write_text("# my adapters\nruns/task-10\n\nruns/task-1  # the first\n")
    assert find_adapters(str(listing)) == [expected[2], expected[0]]
    with pytest.raises(AdapterError, match="no adapter directories"):
        find_adapters(str(tmp_path / "runs" / "notes"))
    with pytest.raises(AdapterError, match="no adapter directories match this pattern"):
        find_adapters(str(tmp_path / "elsewhere-*"))


@pytest.mark.parametrize(
    "tensors, settings, message",
    [(pair(), lora_config(4, peft_type="IA3"), "a IA3 adapter: only LoRA adapters can be compressed"),
     (pair(), lora_config(4, use_dora=True), "a DoRA adapter"),
     (pair(), lora_config(4, rank_pattern={"q_proj": 8}), "rank_pattern gives modules their own rank"),
     (pair() | {"lm_head.weight": np.zeros((3, 3), np.float32)}, lora_config(4),
      "holds lm_head.weight, which is neither a LoRA A nor its B"),
     ({f"{MODULES[0]}.lora_A.weight": np.zeros((4, 8), np.float32)}, lora_config(4), "has lora_A but no lora_B"),
     (pair(rank=4), lora_config(8), "A is (4, 8) and B is (6, 4), not (r, in) and (out, r) with r = 8"),
     ({}, lora_config(4), "holds no LoRA matrices")],
)  # fmt: skip
def test_adapters_that_would_be_compressed_wrongly_are_refused_naming_them(tmp_path, tensors, settings, message):
    directory = write_adapter(tmp_path / "a", tensors, settings)
    with pytest.raises(AdapterError, match=re.escape(message)) as raised:
        open_adapter(str(directory))
    assert str(directory) in str(raised.value)


def test_unreadable_files_are_refused(tmp_path):
    directory = write_adapter(tmp_path / "a", pair(), lora_config(4))
    weights = directory / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:40])
    with pytest.raises(AdapterError, match="adapter_model.safetensors: cannot read it"):
        open_adapter(str(directory))
    weights.unlink()
    with pytest.raises(AdapterError, match="cannot read it"):
        open_adapter(str(directory))
    weights.symlink_to("adapter_model.safetensors")  # a link to itself: a loop, said as one, not "No such file"
    with pytest.raises(AdapterError, match="cannot read it: Too many levels of symbolic links"):
        open_adapter(str(directory))
    (directory / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="adapter_config.json: cannot read it"):
        open_adapter(str(directory))


def test_weights_that_are_not_floating_point_are_refused_naming_the_tensor(tmp_path):
    tensors = {key: (value * 10).astype(np.int32) for key, value in pair().items()}
    directory = write_adapter(tmp_path / "a", tensors, lora_config(4))
    with pytest.raises(AdapterError, match=r"lora_A.weight holds I32 numbers \(and 1 more tensors\): LoRA weights"):
        open_adapter(str(directory))


@pytest.mark.parametrize(
    "changes, tensors, message",
    [({"base_model_name_or_path": "other"}, pair(), "base model 'other', not 'tiny-llama'"),
     ({"target_modules": ["k_proj"]}, pair(), "target modules"),
     ({"r": 2}, pair(rank=2), "rank 2, another than .*(rank 4)"),
     ({}, pair(module=MODULES[1]), "other modules or shapes"),
     ({}, pair(inputs=9), "other modules or shapes .*: a module's shape differs")],
)  # fmt: skip
def test_adapters_of_other_models_ranks_or_modules_are_refused(tmp_path, changes, tensors, message):
    reference = open_adapter(str(write_adapter(tmp_path / "first", pair(), lora_config(4))))
    other = open_adapter(str(write_adapter(tmp_path / "other", tensors, lora_config(4) | changes)))
    with pytest.raises(AdapterError, match=message):
        check_alike(other, reference)
    check_alike(open_adapter(str(write_adapter(tmp_path / "same", pair(), lora_config(4, lora_alpha=3)))), reference)


def test_bfloat16_adapters_read_as_float64_and_nan_is_refused(tmp_path, monkeypatch):
    import torch
    from safetensors.torch import save_file

    tensors = {key: torch.from_numpy(value).to(torch.bfloat16) for key, value in pair().items()}
    directory = tmp_path / "bf16"
    directory.mkdir()
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text((write_adapter(tmp_path / "x", pair(), lora_config(4)) /
                                                    "adapter_config.json").read_text())  # fmt: skip
    adapter = open_adapter(str(directory))
    a, b = adapter.read(adapter.modules[0])
    assert a.dtype == np.float64 and a.shape == (4, 8) and b.shape == (6, 4)
    np.testing.assert_array_equal(a, tensors[f"{MODULES[0]}.lora_A.weight"].to(torch.float64).numpy())
    with monkeypatch.context() as without:  # where torch is not installed: said, not an ImportError's traceback
        without.setitem(sys.modules, "torch", None)
        with pytest.raises(
            AdapterError, match="holds bfloat16 tensors, which numpy lacks; only torch reads it here: pip install torch"
        ):
            adapter.read(adapter.modules[0])
    bad = pair()
    bad[f"{MODULES[0]}.lora_B.weight"][2, 1] = np.nan
    nan = open_adapter(str(write_adapter(tmp_path / "nan", bad, lora_config(4))))
    with pytest.raises(AdapterError, match="q_proj holds NaN or infinite values"):
        nan.read(nan.modules[0])


def test_planted_adapters_read_back(tmp_path):
    write_planted(tmp_path, 2)
    adapter = open_adapter(str(tmp_path / "task-1"))
    assert adapter.name == "task-1" and adapter.rank == 4 and [m.name for m in adapter.modules] == list(MODULES)
    assert (adapter.modules[0].inputs, adapter.modules[0].outputs) == (64, 48)


def test_adapters_are_named_by_the_part_of_their_paths_that_differs():
    """runs/*/adapter held one adapter at most: both were named 'adapter' and the second was refused."""
    from mpiscale.adapters.files import adapter_names

    assert adapter_names(["/x/a", "/x/b"]) == ["a", "b"]
    assert adapter_names(["/w/runs/r0/adapter", "/w/runs/r1/adapter"]) == ["r0", "r1"]
    assert adapter_names(["/w/a/x/adapter", "/w/b/y/adapter", "/w/b/z/adapter"]) == ["a-x", "b-y", "b-z"]
    assert adapter_names(["/w/r0/adapter", "/w/r0/adapter"]) == ["adapter", "adapter"]  # the same one twice: refused
    assert adapter_names(["/w/one/adapter"]) == ["adapter"]


def test_an_adapter_whose_config_is_a_link_nothing_can_follow_is_refused_not_skipped(tmp_path):
    """A symlink loop as adapter_config.json left that adapter out without a word: 7 of 8 compressed, exit 0."""
    write_planted(tmp_path / "runs", 3, 4)
    config = tmp_path / "runs" / "task-1" / "adapter_config.json"
    config.unlink()
    config.symlink_to(config)  # a loop
    with pytest.raises(AdapterError, match=r"task-1/adapter_config.json: is a link that cannot be followed"):
        find_adapters(str(tmp_path / "runs"))
    config.unlink()
    config.symlink_to(tmp_path / "gone.json")  # dangling
    with pytest.raises(AdapterError, match="is a link that cannot be followed"):
        find_adapters(str(tmp_path / "runs" / "task-*"))


def test_an_adapter_saved_as_a_pytorch_pickle_reads_as_its_safetensors_twin_does(tmp_path, monkeypatch):
    """adapter_model.bin (PEFT before 0.6) read whole with torch.load(weights_only=True): the same modules and
    matrices in float64, bfloat16 too; a pickle of something else than tensors by name is refused saying so, a cut
    one too, and one that would run code when unpickled is refused without running it; without torch, it says so."""
    import torch

    tensors = pair()
    safe = write_adapter(tmp_path / "safe", tensors, lora_config(4))
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text((safe / "adapter_config.json").read_text())
    weights = pickled / "adapter_model.bin"
    torch.save({key: torch.from_numpy(value).to(torch.bfloat16) for key, value in tensors.items()}, weights)
    adapter, twin = open_adapter(str(pickled)), open_adapter(str(safe))
    assert adapter.modules == twin.modules and adapter.weights == str(weights)
    for got, expected in zip(adapter.read(adapter.modules[0]), twin.read(twin.modules[0])):
        assert got.dtype == np.float64
        np.testing.assert_allclose(got, expected, rtol=1e-2)  # (bfloat16 keeps 8 bits of the float32 values)
    torch.save({key: torch.from_numpy(value).double() for key, value in tensors.items()}, weights)  # (float64 kept)
    first = adapter.read(adapter.modules[0])[0]
    first[:] = 7.0  # a caller's change to what it read stays its own: the next read gives the file's values
    np.testing.assert_array_equal(adapter.read(adapter.modules[0])[0], tensors[f"{MODULES[0]}.lora_A.weight"])
    torch.save([torch.zeros(2)], weights)
    with pytest.raises(AdapterError, match="adapter_model.bin: holds a list, not tensors by name"):
        open_adapter(str(pickled))
    torch.save({key: torch.from_numpy(value) for key, value in tensors.items()}, weights)
    weights.write_bytes(weights.read_bytes()[:300])
    with pytest.raises(AdapterError, match="adapter_model.bin: cannot read it"):
        open_adapter(str(pickled))
    with monkeypatch.context() as without:  # where torch is not installed (the adapters extra is safetensors alone)
        without.setitem(sys.modules, "torch", None)
        with pytest.raises(
            AdapterError, match="adapter_model.bin: is a PyTorch pickle; only torch reads it here: pip install torch"
        ):
            open_adapter(str(pickled))
    ran = tmp_path / "ran"
    torch.save({"x": _RunsCode(str(ran))}, weights)
    with pytest.raises(AdapterError, match="adapter_model.bin: cannot read it"):
        open_adapter(str(pickled))
    assert not ran.exists()


class _RunsCode:
    """An object whose unpickling would create a file (what a hostile pickle does)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))
