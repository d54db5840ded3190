"""circuits run --device: a user's exported module that makes tensors of its own runs on the job's device.

torch.export bakes the example's device into factory ops (aten.ones(..., device=cpu)); moving the module's
parameters leaves them behind, and on a GPU the first batch fails on mixed devices. The meta device stands in for a
GPU here: the program is moved whole, so no factory op is left on the CPU.
"""

from __future__ import annotations

import torch

from mpiscale.circuits.prefix import ModelRunner
from mpiscale.circuits.store import ModelRef


class MakesTensors(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + torch.ones(x.shape[0], 3) + torch.arange(3.0)


def _factory_devices(module: torch.nn.Module) -> set[str]:
    return {str(node.kwargs["device"]) for node in module.graph.nodes if node.kwargs.get("device") is not None}


def test_an_exported_module_with_factory_ops_moves_whole_to_the_device(tmp_path):
    batch = torch.export.Dim("batch", min=1)
    program = torch.export.export(MakesTensors(), (torch.randn(2, 4),), dynamic_shapes=({0: batch},))
    path = tmp_path / "makes.pt2"
    torch.export.save(program, path)
    model = ModelRef.of(str(path), "export", 4, "float32")
    assert _factory_devices(ModelRunner(model, [""], device="cpu").module) == {"cpu"}
    moved = ModelRunner(model, [""], device="meta").module
    assert _factory_devices(moved) == {"meta"}
    assert {p.device.type for p in moved.parameters()} == {"meta"}
    assert moved(torch.randn(5, 4, device="meta")).shape == (5, 3)


def test_a_torchscript_module_loads_onto_the_device(tmp_path):
    path = tmp_path / "scripted.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(4, 3)), path)
    runner = ModelRunner(ModelRef.of(str(path), "torchscript", 4, "float32"), [""], device="cpu")
    assert runner(torch.randn(2, 4).numpy())[""].shape == (2, 3)
